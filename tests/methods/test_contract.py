"""The method contract (issue 55): a user's scorer in one file gives the built-in method's results through every
path of the runtime; the class tree stays shallow; a broken method file does not take the registry down."""
from __future__ import annotations

import importlib
import inspect
import os
import socket
import sys

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import METHODS, BlockScorerMethod, ScorerMethod, available_methods, build_method
from kvbench.registry import Registry
from kvbench.runtime.contract import NoCompression
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from kvbench.runtime.serving.speculative import SpeculativeDecoder
from tests.tiny_models import DISTINCT_SCORES, ByteTokenizer, tiny_model

BS, CHUNK, BUDGET, NEW = 8, 32, 40, 12
USER_MODULE = "tests.methods.user_method"


def _register_user_method():
    sys.modules.pop(USER_MODULE, None)
    return importlib.import_module(USER_MODULE).MyKnorm


@pytest.fixture
def my_knorm():
    """The one-file method of docs/adding.md, registered as `my_knorm` for this test only."""
    cls = _register_user_method()
    yield cls
    METHODS._items.pop("my_knorm", None)
    sys.modules.pop(USER_MODULE, None)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)


def _prompts(lengths=(100, 61, 133), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, method, **kw):
    return Engine(model, method, block_size=BS, num_blocks=4096, prefill_chunk_size=CHUNK, prefix_caching=False, **kw)


def _kept(engine, slot):
    lengths = engine.cache.lengths[slot]
    return [[engine.cache.positions[slot, li, h, : int(lengths[li, h])].tolist() for h in range(lengths.shape[1])]
            for li in range(lengths.shape[0])]


def _prefill(model, method, ids):
    engine = _engine(model, method)
    slot = engine.new_sequence()
    for a in range(0, len(ids), CHUNK):
        engine.forward_chunk(slot, ids[a: a + CHUNK], a, last_chunk=a + CHUNK >= len(ids), logits_for="none")
    return _kept(engine, slot)


@pytest.mark.parametrize("options", [{}, {"decode": "evict"}, {"prefill_mode": "streaming"}])
def test_the_one_file_method_keeps_knorms_tokens(model, my_knorm, options):
    ids = _prompts()[0]
    mine = _prefill(model, build_method("my_knorm", BUDGET, **options), ids)
    assert mine == _prefill(model, build_method("knorm", BUDGET, **options), ids)
    assert all(len(head) == BUDGET for layer in mine for head in layer)  # it did compress


def test_the_one_file_method_gives_knorms_perplexity_and_generations(model, my_knorm):
    ids = _prompts()[2]
    for options in ({}, {"decode": "evict"}):
        lp = {n: Scorer(_engine(model, build_method(n, BUDGET, **options))).score(ids, chunk_size=CHUNK)
              for n in ("my_knorm", "knorm")}
        assert torch.equal(lp["my_knorm"], lp["knorm"])
        gen = {n: [g.token_ids for g in _engine(model, build_method(n, BUDGET, **options)).generate(
            _prompts(), max_new_tokens=NEW)] for n in ("my_knorm", "knorm")}  # ragged batches, decode steps
        assert gen["my_knorm"] == gen["knorm"]
    full = Scorer(_engine(model, None)).score(ids, chunk_size=CHUNK)
    assert not torch.equal(full, lp["knorm"])  # the comparison can fail: compression changed the scores


def test_the_one_file_method_takes_a_compression_ratio_and_drafts(model, my_knorm):
    assert _prefill(model, build_method("my_knorm", compression_ratio=0.5), _prompts()[0]) == \
        _prefill(model, build_method("knorm", compression_ratio=0.5), _prompts()[0])
    reference = [g.token_ids for g in _engine(model, None).generate(_prompts(), max_new_tokens=NEW)]
    spec = SpeculativeDecoder(_engine(model, build_method("my_knorm", 32, decode="evict")), 3, adaptive=True)
    target = _engine(model, None, speculator=spec)
    assert [g.token_ids for g in target.generate(_prompts(), max_new_tokens=NEW)] == reference
    assert spec.stats.draft_tokens > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from kvbench.runtime.model import distributed
    from kvbench.runtime.model.tensor_parallel import shard_model

    _register_user_method()
    layout = distributed.init_from_env(tensor_parallel=world)
    try:
        full = tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)
        shard = shard_model(full, layout.tp_rank, layout.tp_size, layout.tp_group)
        ids = _prompts()[2]
        out = {}
        for name, model in (("tp", shard), ("ref", full)):
            out[name] = Scorer(_engine(model, build_method("my_knorm", BUDGET, decode="evict"))).score(ids)
        if rank == 0:
            torch.save(out, out_path)
    finally:
        distributed.destroy()


def test_the_one_file_method_runs_tensor_parallel(tmp_path):
    import torch.multiprocessing as mp

    out = str(tmp_path / "tp.pt")
    ctx = mp.start_processes(_tp_worker, args=(2, _free_port(), out), nprocs=2, join=False, start_method="spawn")
    import time

    deadline = time.monotonic() + 120
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):  # True once every worker has ended
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("tensor-parallel workers did not finish within 120 s")
    r = torch.load(out, weights_only=False)
    torch.testing.assert_close(r["tp"], r["ref"], rtol=1e-4, atol=1e-4)


def _depth(cls: type) -> int:
    """Inheritance edges from cls up to NoCompression (the hook protocol's default)."""
    if cls is NoCompression:
        return 0
    return 1 + max((_depth(b) for b in cls.__bases__ if issubclass(b, NoCompression)), default=0)


def test_inheritance_is_at_most_three_deep():
    deep = {n: _depth(METHODS[n]) for n in available_methods() if _depth(METHODS[n]) > 3}
    assert deep == {}
    assert _depth(ScorerMethod) == 2 and _depth(BlockScorerMethod) == 2


def test_a_scorer_declares_what_it_observes_instead_of_coding_it():
    snapkv, h2o, knorm = (build_method(n, 64) for n in ("snapkv", "h2o", "knorm"))
    assert (snapkv.query_window, snapkv.needs_key_scores) == (64, False)
    assert (h2o.query_window, h2o.needs_key_scores) == (0, True)
    assert (knorm.query_window, knorm.needs_key_scores) == (0, False)
    for name in ("knorm", "snapkv", "h2o", "tova", "random", "lagkv", "expected_attention", "key_diff",
                 "paged_eviction"):
        assert list(inspect.signature(METHODS[name].score).parameters) == ["self", "obs"], name


def test_a_broken_method_file_is_named_and_the_others_still_load(tmp_path, monkeypatch):
    pkg = tmp_path / "user_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("from tests.methods.test_contract import REG\n@REG.register('good')\nclass Good: pass\n")
    (pkg / "typo.py").write_text("from kvbench.methods import ScorerMetod\n")
    (pkg / "syntax.py").write_text("def score(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    global REG
    REG = Registry("method", package="user_methods")
    assert REG.names() == ["good"]
    with pytest.raises(UserError, match=r"method 'typo' failed to load: .*typo\.py: ImportError: cannot import name "
                                        r"'ScorerMetod'"):
        REG.get("typo")
    with pytest.raises(UserError, match=r"method 'syntax' failed to load: .*syntax\.py \(line 1\): SyntaxError"):
        REG.get("syntax")
    with pytest.raises(UserError, match=r"unknown method 'nope'; choices are good; not loaded \(import failed\): "
                                        r"syntax, typo"):
        REG.get("nope")
    assert REG.get("good").__name__ == "Good"


REG: Registry | None = None


def test_a_second_registration_of_a_name_is_refused_naming_both_files(tmp_path, monkeypatch):
    """A user's file registering a built-in's name (or two user files with one name) never silently wins: asking for
    the name is refused in one line naming both files; the other names still load."""
    pkg = tmp_path / "clash_methods"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "from tests.methods.test_contract import REG\n@REG.register({name!r})\nclass {cls}: pass\n"
    (pkg / "aaa_shadow.py").write_text(body.format(name="knorm", cls="Shadow"))
    (pkg / "knorm.py").write_text(body.format(name="knorm", cls="Knorm"))
    (pkg / "zz_other.py").write_text(body.format(name="other", cls="Other"))
    monkeypatch.syspath_prepend(str(tmp_path))
    global REG
    REG = Registry("method", package="clash_methods")
    with pytest.raises(UserError) as info:
        REG.get("knorm")
    line = str(info.value)
    assert "\n" not in line and line.startswith("method 'knorm' is registered twice, by ")
    assert str(pkg / "aaa_shadow.py") in line and str(pkg / "knorm.py") in line, line
    assert REG.get("other").__name__ == "Other"
    mod = importlib.import_module("clash_methods.zz_other")
    importlib.reload(mod)  # a module reloaded from its own file replaces its entry, no clash
    assert REG.get("other") is mod.Other
