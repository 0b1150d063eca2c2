"""`compression_ratio` (kvpress's knob): config rules, the per-sequence budget of every eviction method (read from
the block tables), and tokens appended uncompressed (`Engine.forward_chunk(compress=False)`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import METHODS, build_method
from kvbench.methods.eviction import EvictionMethod
from kvbench.runtime.serving.engine import Engine
import kvbench.run.config as kconfig
from tests.harness_fakes import compose
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import ByteTokenizer, tiny_model
from tests.methods.test_matrix import _over_budget
from tests.methods.variants import VARIANTS, budgeted, rotated

CHUNK = 64
BS = 16
PROMPTS = (200, 333)
EVICTING = [v for v in budgeted(VARIANTS) if issubclass(METHODS[v[0]], EvictionMethod)]


def _uniform_tables(method) -> bool:
    """Whether every table of the method has the same budget (no per-layer, per-head or head-adaptive budgets)."""
    return (getattr(method, "budget_scope", "table") == "table"
            and type(method).table_budget is EvictionMethod.table_budget)


def _bounded_lengths(method, cache, slot: int) -> list[int]:
    """Token counts of the tables the budget bounds (all but duo_attention's retrieval heads)."""
    table_scope = getattr(method, "budget_scope", "table") == "table"
    return [int(cache.lengths[slot, li, h]) for li in range(cache.num_layers) for h in range(cache.num_kv_heads)
            if not table_scope or method.table_budget(li, h) is not None]


def _id(v):
    name, opts = v
    return name + "".join(f"-{k}={x}" for k, x in opts.items())


one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, tokenizer=ByteTokenizer(256))  # kvzip writes its reconstruction prompt with it


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed + n)).tolist()


def _prefill(engine: Engine, slot: int, ids: list[int], start: int = 0, *, compress: bool = True):
    """Chunked prefill through the engine's public API; the last chunk ends the prompt."""
    out = None
    for a in range(0, len(ids), CHUNK):
        b = min(len(ids), a + CHUNK)
        out = engine.forward_chunk(slot, ids[a:b], start + a, last_chunk=b == len(ids), compress=compress)
    return out


def _tables(cache, slot):
    """Positions kept by every (layer, kv-head) table of a sequence: list over layers of lists over heads."""
    return [[cache.positions[slot, layer, h, : int(cache.lengths[slot, layer, h])].tolist()
             for h in range(cache.lengths.shape[2])] for layer in range(cache.lengths.shape[1])]


# --------------------------------------------------------------------------- config
def test_config_accepts_a_ratio_and_refuses_both_knobs():
    s = kconfig.validate(compose(["method=snapkv", "compression_ratio=0.5"]))
    assert s.compression_ratio == 0.5 and s.budget is None
    with pytest.raises(UserError, match=r"budget=64 and compression_ratio=0.5 are both set"):
        kconfig.validate(compose(["method=snapkv", "budget=64", "compression_ratio=0.5"]))
    for bad in ("1.0", "-0.1", "1.5"):
        with pytest.raises(UserError, match=rf"invalid compression_ratio={bad}: expected a number in \[0, 1\)"):
            kconfig.validate(compose(["method=snapkv", f"compression_ratio={bad}"]))
    # a method that keeps every token: the ratio is meaningless and recorded as null (one run for any ratio)
    assert kconfig.validate(compose(["method=full", "compression_ratio=0.5"])).compression_ratio is None


def test_ratio_changes_the_run_id_and_null_keeps_old_ids():
    from kvbench.store.naming import run_id_for

    base = kconfig.hashable_config(compose(["method=snapkv"]))
    assert "compression_ratio" not in base  # runs without a ratio keep the ids they had
    a = run_id_for(kconfig.hashable_config(compose(["method=snapkv", "compression_ratio=0.5"])))
    b = run_id_for(kconfig.hashable_config(compose(["method=snapkv", "compression_ratio=0.25"])))
    assert a != b
    full = [run_id_for(kconfig.hashable_config(compose(["method=full", f"compression_ratio={r}"])))
            for r in (0.25, 0.5)]
    assert full[0] == full[1]


def test_both_knobs_exit_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvbench", "method=snapkv", "budget=64", "compression_ratio=0.5",
                           f"results_dir={tmp_path}", "logger=none"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "budget=64 and compression_ratio=0.5 are both set" in lines[0]
    assert "Traceback" not in proc.stderr


def test_build_method_rules():
    m = build_method("snapkv", None, compression_ratio=0.3)
    assert m.compression_ratio == 0.3 and m.describe()["compression_ratio"] == 0.3
    with pytest.raises(UserError, match="needs a budget"):
        build_method("snapkv", None)
    with pytest.raises(UserError, match="unknown option method.compression_ratio"):
        build_method("snapkv", None, **{"compression_ratio_x": 1})
    for name, opts in EVICTING:  # describe() works without a fixed budget (its derived sizes are per sequence)
        d = build_method(name, None, compression_ratio=0.5, **opts).describe()
        assert d["budget"] is None and d["compression_ratio"] == 0.5


# --------------------------------------------------------------------------- per-sequence budgets
@pytest.mark.parametrize("variant,mode", rotated(EVICTING, [("paper",), ("streaming",)], ("mode",)))
def test_half_ratio_keeps_half_of_each_prompt(model, variant, mode):
    name, opts = variant
    method = build_method(name, None, compression_ratio=0.5, **{**opts, "prefill_mode": mode})
    if not getattr(method, "compresses_prompt", True):
        pytest.skip("compresses while decoding only (decoding, CaM alone: tests/methods/test_kvpress_d.py)")
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    slots = []
    for n in PROMPTS:  # two live sequences of different lengths: each gets its own budget
        slot = engine.new_sequence()
        _prefill(engine, slot, _ids(n))
        slots.append((slot, n))
    every_table_bounded = True
    for slot, n in slots:
        want = n // 2
        if _uniform_tables(method):
            for layer, heads in enumerate(_tables(engine.cache, slot)):
                for h, pos in enumerate(heads):
                    assert abs(len(pos) - want) <= BS, f"{name}: layer {layer} head {h} kept {len(pos)} of {n}"
                    assert len(pos) <= want, f"{name}: over the budget int({n} * 0.5)"
        elif not getattr(method, "budget_bounds_tables", True):  # lukv: its curve sizes the tables
            every_table_bounded = False  # tests/methods/test_kvpress_d.py checks its counts against kvpress's
        else:  # per-layer (pyramidkv), head-adaptive (adakv, kvzip) or per-head (duo_attention) budgets
            method.budget = want  # the method holds the budget of the last sequence it compressed
            why = _over_budget(method, engine.cache, slot, None, want, 0)
            assert why is None, f"{name}: {why}"
            bounded = _bounded_lengths(method, engine.cache, slot)
            every_table_bounded &= len(bounded) == engine.cache.num_layers * engine.cache.num_kv_heads
            mean = sum(bounded) / len(bounded)
            assert want - BS <= mean <= want, f"{name}: the budgeted tables keep {mean:.1f} on average, not {want}"
    stats = method.prefill_stats()
    assert stats["prompt_tokens_mean"] == sum(PROMPTS) / 2
    if every_table_bounded:  # duo_attention's retrieval heads keep every token
        assert 0.5 - BS / min(PROMPTS) <= stats["kv_kept_fraction"] <= 0.5
    for slot, _ in slots:
        engine.end_sequence(slot)
    assert engine.cache.pool.in_use == 0 and not method._budgets._sequences


@pytest.mark.parametrize("mode", ["paper", "streaming"])
def test_kvzip_reconstruction_is_not_counted_as_prompt(model, mode):
    """KVzip's reconstruction pass (Engine.forward_chunk(scratch=True)) leaves the sequence's token count, the
    uncompressed figure (full_kv_bytes) and prefill_stats to the context alone; its blocks still show in the peak."""
    ids = _ids(300)
    engines = {}
    for name in ("full", "kvzip"):
        method = build_method(name, None, compression_ratio=0.5, chunk_size=48, prefill_mode=mode) \
            if name == "kvzip" else None
        engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
        slot = engine.new_sequence()
        _prefill(engine, slot, ids)
        assert engine.cache.tokens_seen[slot] == len(ids), name
        engines[name] = engine
    full, kvzip = (engines[n].memory_stats() for n in ("full", "kvzip"))
    assert kvzip["full_kv_bytes"] == full["full_kv_bytes"]
    assert kvzip["kv_bytes_in_use"] < full["kv_bytes_in_use"]
    # held_kv_bytes is measured after kvzip evicts at the prompt's end (its after_prefill_chunk hook), not before:
    # about half of the uncompressed bytes, as the full run holds them all
    assert full["held_kv_bytes"] == full["full_kv_bytes"]
    assert kvzip["held_kv_bytes"] == kvzip["kv_bytes_in_use"] < 0.6 * full["full_kv_bytes"]
    stats = engines["kvzip"].method.prefill_stats()
    assert stats["prompt_tokens_mean"] == len(ids) and 0.5 - BS / len(ids) <= stats["kv_kept_fraction"] <= 0.5


@pytest.mark.parametrize("variant", EVICTING, ids=_id)
def test_ratio_zero_keeps_every_prompt_token(model, variant):
    name, opts = variant
    method = build_method(name, None, compression_ratio=0.0, **opts)
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    slot = engine.new_sequence()
    _prefill(engine, slot, _ids(150))
    assert all(len(pos) == 150 for heads in _tables(engine.cache, slot) for pos in heads)


# --------------------------------------------------------------------------- uncompressed tokens
@pytest.mark.parametrize("variant", EVICTING, ids=_id)
def test_question_appended_uncompressed_stays_whole(model, variant):
    """Context compressed to its budget, then the question appended with compress=False: every question token is
    in every table, and the budget grew by the question's length."""
    name, opts = variant
    method = build_method(name, 64, **opts)
    if not getattr(method, "compresses_prompt", True):
        pytest.skip("compresses while decoding only (decoding, CaM alone: tests/methods/test_kvpress_d.py)")
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    slot = engine.new_sequence()
    context, question = _ids(300), _ids(40, seed=7)
    _prefill(engine, slot, context)
    assert _over_budget(method, engine.cache, slot, None, 64, 0) is None
    logits = _prefill(engine, slot, question, start=len(context), compress=False)
    assert logits is not None
    # the question's positions follow the context's (300..339), or the compressed length where the method
    # continues there (finch re-rotates its kept keys to 0..n-1: kvpress's pipeline goes on at n)
    start = 64 if getattr(method, "rerotate_keys", False) else 300
    q_pos = set(range(start, start + 40))
    for heads in _tables(engine.cache, slot):
        for pos in heads:
            assert q_pos <= set(pos)
    assert _over_budget(method, engine.cache, slot, None, 64, 40) is None
    # the same question compressed with its context: some question tokens may go, and the budget holds
    method2 = build_method(name, 64, **opts)
    engine2 = Engine(model, method2, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    slot2 = engine2.new_sequence()
    _prefill(engine2, slot2, context + question)
    assert _over_budget(method2, engine2.cache, slot2, None, 64, 0) is None


# --------------------------------------------------------------------------- task.compress_question
def _tables_after_prefill(engine, requests):
    """Generate for the requests (their questions uncompressed) and read every sequence's tables when its prefill is
    over (at its first decode step)."""
    seen: dict[int, list] = {}
    step = engine.step

    def spy(segments, *args, **kwargs):
        for s in segments:
            if s.phase == "decode":
                seen.setdefault(s.slot, _tables(engine.cache, s.slot))
        return step(segments, *args, **kwargs)

    engine.step = spy
    gens = engine.generate([r.token_ids for r in requests], max_new_tokens=requests[0].max_new_tokens,
                           stop_token_ids=requests[0].stop_ids,
                           uncompressed_tails=[r.uncompressed_tail for r in requests])
    return gens, seen


@pytest.mark.parametrize("name", ["snapkv", "streaming_llm", "key_diff", "h2o"])
def test_needle_question_uncompressed_is_all_in_the_cache(name):
    """task.compress_question=false: after prefill every question token is in every table; the context is
    compressed to the budget. With true (the default) the question is tokenized with the prompt and compressed."""
    from kvbench.tasks import build_task
    from tests.fixtures.task_fixtures import smollm2_tokenizer, tiny_engine

    tok = smollm2_tokenizer()
    opts = {"lengths": [256], "depths": [50], "max_new_tokens": 3}
    (req,) = build_task("needle", {**opts, "compress_question": False}).requests(tok)
    (whole,) = build_task("needle", opts).requests(tok)
    assert whole.uncompressed_tail == 0 and req.uncompressed_tail > 10
    assert tok.decode(req.token_ids[-req.uncompressed_tail:]).startswith("What is the best thing to do in San")
    assert tok.decode(req.token_ids[-req.uncompressed_tail:]).endswith("<|im_start|>assistant\n")
    budget = 64
    method = build_method(name, budget, decode="none") if name != "h2o" else build_method(name, budget)
    engine = tiny_engine(method, block_size=BS)
    gens, seen = _tables_after_prefill(engine, [req])
    (tables,) = seen.values()
    n, tail = len(req.token_ids), req.uncompressed_tail
    question = set(range(n - tail, n))
    for heads in tables:
        for pos in heads:
            assert question <= set(pos), f"{name}: question tokens evicted"
            assert len(pos) <= budget + tail and len([p for p in pos if p < n - tail]) <= budget
    assert len(gens[0].token_ids) >= 1 and engine.cache.pool.in_use == 0


def test_uncompressed_tail_without_eviction_equals_the_whole_prompt():
    """With nothing evicted, prefilling context then question (uncompressed) and decoding the batch together
    gives the greedy tokens of the same token ids prefilled whole."""
    from kvbench.tasks._generation import GenRequest
    from tests.fixtures.task_fixtures import tiny_engine

    reqs = [GenRequest(id=str(n), dataset=None, prompt="", token_ids=_ids(n), max_new_tokens=6,
                       uncompressed_tail=t) for n, t in ((150, 20), (90, 70))]
    engine = tiny_engine(None, block_size=BS)
    split = engine.generate([r.token_ids for r in reqs], max_new_tokens=6,
                            uncompressed_tails=[r.uncompressed_tail for r in reqs])
    ref = engine.generate([r.token_ids for r in reqs], max_new_tokens=6)
    assert [g.token_ids for g in split] == [g.token_ids for g in ref]
    assert all(g.finish_reason == "length" and len(g.token_ids) == 6 for g in split)


def test_compare_pairs_runs_by_ratio(tmp_path):
    """kvbench-compare's pairing key holds the ratio: two ratios never pair; `full` ignores it."""
    from kvbench.reporting.runs import pair_key
    from kvbench.store.runs import make_run

    def run(method, ratio, with_config=True):
        config = {"model": {"name": "m"}, "method": {"name": method}, "quant": {"name": "none"},
                  "task": {"name": "ruler"}, "runtime": {}, "budget": None, "compression_ratio": ratio, "seed": 0}
        metrics = {"run_id": f"{method}-{ratio}", "model": "m", "method": method, "task": "ruler", "budget": None,
                   "compression_ratio": ratio, "seed": 0, "evicts": method != "full"}  # as kvbench.run.app records it
        return make_run(str(tmp_path), metrics, config if with_config else {})

    assert pair_key(run("snapkv", 0.25)) != pair_key(run("snapkv", 0.5))
    assert pair_key(run("snapkv", 0.25, False)) != pair_key(run("snapkv", 0.5, False))
    assert pair_key(run("snapkv", 0.5)) == pair_key(run("snapkv", 0.5))
    assert pair_key(run("full", 0.25)) == pair_key(run("full", None))
