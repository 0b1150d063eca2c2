"""Golden serving figures: greedy tokens, pool bytes and blocks, preemptions and log-probabilities of a fixed small
setup, compared with tests/fixtures/golden_serving.json (recorded from the runtime before its serving core was
reorganised). A change to what the engine computes or what the pool holds fails here.

    PYTHONPATH=$PWD/src python -m tests.runtime.test_golden_serving --write    # record the fixture again

Tokens, byte and block counts compare exactly; log-probabilities within 1e-5.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Callable

import pytest
import torch

from kvbench.methods import build_method
from kvbench.quant.registry import build_codec
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scheduler import Request
from kvbench.runtime.serving.scoring import Scorer
from kvbench.runtime.serving.speculative import SpeculativeDecoder
from tests.tiny_models import DISTINCT_SCORES, SMOLLM2_TOKEN_IDS, tiny_model

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "golden_serving.json")
LOGPROB_TOL = 1e-5
BS = 8  # tokens per block
ROOMY = 512  # blocks: every request runs at once
NEW = 12  # tokens generated per prompt
TIGHT = 60  # blocks
TIGHT_PROMPTS = (40, 44, 38, 41, 30, 36)
KIVI = {"group_size": 16, "residual": 16}  # 16-token blocks: packing within a few steps

# (method, budget, options) of the generation cases; budgets well under the prompts so eviction happens
METHODS = {
    "full": ("full", None, {}),
    "streaming_llm": ("streaming_llm", 24, {}),
    "h2o": ("h2o", 24, {}),
    "paged_eviction": ("paged_eviction", 32, {}),
    "snapkv": ("snapkv", 24, {"window": 8}),
}
MEMORY_FIELDS = ("peak_kv_bytes", "full_kv_bytes", "held_kv_bytes", "fork_shared_kv_bytes", "kv_bytes_per_token",
                 "kv_bytes_in_use", "num_blocks", "peak_blocks_in_use", "kv_pool_bytes", "max_sequence_tokens")


def golden_model():
    """A 2-layer random Llama over 256 tokens (2 kv-heads of 4 query heads, head_dim 16), sharpened attention."""
    return tiny_model(vocab=256, max_positions=1024, **DISTINCT_SCORES, **SMOLLM2_TOKEN_IDS)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, name: str = "full", budget: int | None = None, codec: Any = None, **options: Any) -> Engine:
    engine_opts = {k: options.pop(k) for k in ("num_blocks", "prefill_chunk_size", "prefix_caching", "speculator",
                                               "preemption", "swap_bytes") if k in options}
    engine_opts.setdefault("num_blocks", ROOMY)
    engine_opts.setdefault("prefill_chunk_size", 16)
    return Engine(model, build_method(name, budget, **options), codec=codec, block_size=BS, **engine_opts)


def _memory(engine: Engine) -> dict:
    stats = engine.memory_stats()
    out = {k: stats[k] for k in MEMORY_FIELDS}
    out["blocks_in_use"] = engine.cache.pool.in_use
    return out


def _serve(engine: Engine, prompts: list[list[int]], new: int = NEW) -> dict:
    """Serve the prompts (all at once); tokens, preemptions, the pool's blocks in use after every step, figures."""
    trace: list[int] = []
    reqs = [Request(p, new) for p in prompts]
    out = engine.serve(reqs, on_step=lambda _n: trace.append(engine.cache.pool.in_use))
    return {"tokens": [r.output for r in reqs], "status": [r.status for r in reqs],
            "preemptions": out.preemptions, "blocks_in_use_per_step": trace, "memory": _memory(engine)}


def _logprobs(t: torch.Tensor | list[float]) -> list[float]:
    return [round(float(x), 6) for x in (t.tolist() if isinstance(t, torch.Tensor) else t)]


# --------------------------------------------------------------------------- the cases
def _generate_case(name: str) -> Callable[[Any], dict]:
    method, budget, options = METHODS[name]

    def run(model) -> dict:
        engine = _engine(model, method, budget, **options)
        gens = engine.generate(_prompts((40, 57, 23), 1), max_new_tokens=NEW)
        return {"tokens": [g.token_ids for g in gens], "memory": _memory(engine)}
    return run


def _kivi(model) -> dict:
    engine = _engine(model, codec=build_codec("kivi", model, **KIVI))
    gens = engine.generate(_prompts((40, 57, 23), 1), max_new_tokens=NEW)
    out = {"tokens": [g.token_ids for g in gens], "memory": _memory(engine)}
    out["logprobs"] = _logprobs(engine.score(_prompts((60,), 2)[0]))
    out["memory_after_score"] = _memory(engine)
    return out


def _tight_pool(model, method: str, budget: int | None, **options: Any) -> Engine:
    """A pool of TIGHT blocks: six prompts are admitted and their decoding outgrows it, so some are preempted."""
    return _engine(model, method, budget, num_blocks=TIGHT, prefix_caching=False, **options)


def _tight_full(model) -> dict:
    return _serve(_tight_pool(model, "full", None), _prompts(TIGHT_PROMPTS, 3), new=24)


def _tight_paged_eviction(model) -> dict:
    return _serve(_tight_pool(model, "paged_eviction", 32), _prompts(TIGHT_PROMPTS, 3), new=24)


def _swap(model) -> dict:
    """The tight pool with preemption by swapping blocks to host memory."""
    engine = _tight_pool(model, "full", None, preemption="swap", swap_bytes=1 << 30)
    out = _serve(engine, _prompts(TIGHT_PROMPTS, 3), new=24)
    out["swap_blocks_out"] = engine.swap.blocks_out
    return out


def _prefix_cache(model) -> dict:
    """Prompts sharing 40 tokens (5 blocks) with the prefix cache on: shared blocks, then copy-on-write."""
    prompts = _prompts((60, 52, 70), 4)
    prompts = [prompts[0][:40] + p[40:] for p in prompts]
    engine = _engine(model, prefix_caching=True)
    return _serve(engine, prompts)


def _speculative(model) -> dict:
    """Self-speculation: a streaming_llm draft over the same model; rejected drafts are truncated away."""
    draft = _engine(model, "streaming_llm", 24)
    target = _engine(model, speculator=SpeculativeDecoder(draft, 3))
    out = _serve(target, _prompts((40, 33), 5), new=16)
    out["draft_memory"] = _memory(draft)
    return out


def _scores(model) -> dict:
    """score() through full, h2o and paged_eviction; score_continuations() (forks sharing blocks)."""
    seq = _prompts((90,), 6)[0]
    ctx, conts = seq[:50], [seq[50:58], seq[58:64], seq[64:75]]
    out = {}
    for name, budget in (("full", None), ("h2o", 24), ("paged_eviction", 32)):
        engine = _engine(model, name, budget)
        res = Scorer(engine).score_continuations(ctx, conts)
        out[name] = {"score": _logprobs(engine.score(seq)),
                     "continuations": [_logprobs(lp) for lp, _ in res], "greedy": [g for _, g in res],
                     "memory": _memory(engine)}
    return out


CASES: dict[str, Callable[[Any], dict]] = {
    **{name: _generate_case(name) for name in METHODS},
    "kivi": _kivi,
    "tight_full": _tight_full,
    "tight_paged_eviction": _tight_paged_eviction,
    "swap": _swap,
    "prefix_cache": _prefix_cache,
    "speculative": _speculative,
    "scores": _scores,
}


# --------------------------------------------------------------------------- comparison
def assert_matches(got: Any, want: Any, where: str = "") -> None:
    """got == want, floats within LOGPROB_TOL; ints, strings, lists and keys exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_matches(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=0, abs_tol=LOGPROB_TOL), \
            f"{where}: {got} != {want}"
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def _json_round_trip(record: dict) -> dict:
    return json.loads(json.dumps(record))


@pytest.fixture(scope="module")
def model():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield golden_model()
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def golden() -> dict:
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


def test_the_fixture_has_every_case(golden):
    assert sorted(golden) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_serving_matches_the_golden_record(model, golden, case):
    assert_matches(_json_round_trip(CASES[case](model)), golden[case], case)


def test_the_comparison_catches_a_changed_token_byte_or_logprob():
    want = {"tokens": [[5, 6]], "memory": {"peak_kv_bytes": 4096}, "logprobs": [-1.25]}
    assert_matches({"tokens": [[5, 6]], "memory": {"peak_kv_bytes": 4096}, "logprobs": [-1.250004]}, want)
    for bad in ({"tokens": [[5, 7]], "memory": {"peak_kv_bytes": 4096}, "logprobs": [-1.25]},
                {"tokens": [[5, 6]], "memory": {"peak_kv_bytes": 4160}, "logprobs": [-1.25]},
                {"tokens": [[5, 6]], "memory": {"peak_kv_bytes": 4096}, "logprobs": [-1.2501]}):
        with pytest.raises(AssertionError):
            assert_matches(bad, want)


def write_fixture() -> None:
    """Run every case and write the fixture."""
    torch.set_num_threads(1)
    m = golden_model()
    record = {name: _json_round_trip(run(m)) for name, run in CASES.items()}
    with open(FIXTURE, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {FIXTURE} ({len(record)} cases)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.runtime.test_golden_serving --write")
    write_fixture()
