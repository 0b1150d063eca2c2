"""Requests served from a forked, compressed context (`Request.fork_of`, `Engine.prefill_context`): the
multi-request protocol's engine operations.

- full: every forked request's greedy tokens equal an independent `generate` of the same whole prompt;
- the context is compressed once, however many requests fork it (the method's own count of compressions);
- the forks share the context's blocks: the pool's blocks in use and its shared references, measured, while they
  run (a compressing method: fewer blocks than independent copies);
- prefix caching on: a second prefill_context of the same tokens is a hit (no compression, the same blocks,
  the same answers); a different context is not;
- bad requests are refused.
"""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.requests import Request
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import tiny_model

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)
CTX, NEW = 150, 6


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, max_positions=512)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _questions() -> list[list[int]]:
    return [_ids(n, 100 + n) for n in (5, 17, 30)]


def _compressions(engine: Engine) -> int:
    totals = engine.method.prefill_totals() or [0, 0, 0]
    return int(totals[2]) // engine.model.config.num_layers


def _serve_forks(engine: Engine, ctx: list[int], qs: list[list[int]], tail: bool = True):
    pre = engine.prefill_context(ctx)
    peaks = []

    def on_step(_n):  # blocks in use and shared references while the forks run, measured from the pool
        pool = engine.cache.pool
        peaks.append((pool.in_use, pool.shared_refs))

    reqs = [Request(ctx + q, NEW, fork_of=pre.slot, fork_tokens=len(ctx), uncompressed_tail=len(q) if tail else 0)
            for q in qs]
    out = engine.serve(reqs, on_step=on_step)
    engine.end_sequence(pre.slot)
    return pre, out, peaks


def test_full_forks_equal_independent_generations(model):
    ctx, qs = _ids(CTX, 1), _questions()
    engine = Engine(model, prefill_chunk_size=32, prefix_caching=False)
    _, out, peaks = _serve_forks(engine, ctx, qs)
    alone = Engine(model, prefill_chunk_size=32, prefix_caching=False)
    for r, q in zip(out.requests, qs):
        ref = alone.generate([ctx + q], max_new_tokens=NEW)[0]
        assert r.output == ref.token_ids
    assert out.forked_prompt_tokens == len(qs) * CTX
    assert max(s for _, s in peaks) > 0  # the context's blocks were referenced by several tables at once
    assert engine.cache.pool.in_use == 0 and engine.cache.pool.shared_refs == 0


@pytest.mark.parametrize("name,budget", [("snapkv", 48), ("streaming_llm", 48)])
def test_context_compressed_once_and_shared(model, name, budget):
    ctx, qs = _ids(CTX, 2), _questions()
    engine = Engine(model, build_method(name, budget=budget), prefill_chunk_size=32, prefix_caching=False)
    pre, out, peaks = _serve_forks(engine, ctx, qs)
    assert _compressions(engine) == 1  # one context, three requests
    assert all(r.finish_reason in ("length", "stop") and r.output for r in out.requests)
    # what one compressed context holds (budget tokens per table), measured: L x H tables of ceil(48 / 16) blocks
    cfg = model.config
    one_copy = cfg.num_layers * cfg.num_kv_heads * 3
    most, shared = max(peaks)
    assert shared >= one_copy  # the context's blocks referenced by more than one table
    # in bytes, as the run records it (the pool's shared references x its block bytes, tracked every step)
    assert engine.memory_stats()["fork_shared_kv_bytes"] >= one_copy * engine.cache.bytes_per_block
    # three independent copies of the compressed context would need 3 x one_copy blocks for the context alone
    assert most < 3 * one_copy + len(qs) * cfg.num_layers * cfg.num_kv_heads * 4
    # each fork equals a fork of a context compressed for it alone
    for r, q in zip(out.requests, qs):
        solo = Engine(model, build_method(name, budget=budget), prefill_chunk_size=32, prefix_caching=False)
        _, one, _ = _serve_forks(solo, ctx, [q])
        assert r.output == one.requests[0].output


def test_question_compressed_on_the_fork_leaves_the_context(model):
    """compress the question too: each fork compresses again (its own copies), the context's blocks stay."""
    ctx, qs = _ids(CTX, 3), _questions()
    engine = Engine(model, build_method("snapkv", budget=48), prefill_chunk_size=32, prefix_caching=False)
    _, out, _ = _serve_forks(engine, ctx, qs, tail=False)
    assert _compressions(engine) == 1 + len(qs)
    assert engine.cache.pool.in_use == 0


def test_prefix_cache_hits_the_compressed_context(model):
    ctx, other, qs = _ids(CTX, 4), _ids(CTX, 5), _questions()
    engine = Engine(model, build_method("snapkv", budget=48), prefill_chunk_size=32, prefix_caching=True)
    first, out1, _ = _serve_forks(engine, ctx, qs)
    assert not first.hit and _compressions(engine) == 1
    kept_blocks = engine.cache.pool.in_use  # the kept compressed copy only
    assert kept_blocks > 0
    second, out2, _ = _serve_forks(engine, ctx, qs)
    assert second.hit and _compressions(engine) == 1  # nothing compressed again
    assert [r.output for r in out2.requests] == [r.output for r in out1.requests]
    assert engine.cache.pool.in_use == kept_blocks  # served from the kept blocks, none added
    third = engine.prefill_context(other)
    assert not third.hit and _compressions(engine) == 2
    engine.end_sequence(third.slot)
    assert (engine.context_lookups, engine.context_hits) == (3, 1)
    engine.release_contexts()
    assert engine.cache.pool.in_use == 0


def test_prefix_cache_off_never_keeps(model):
    engine = Engine(model, build_method("snapkv", budget=48), prefill_chunk_size=32, prefix_caching=False)
    a = engine.prefill_context(_ids(CTX, 6))
    engine.end_sequence(a.slot)
    b = engine.prefill_context(_ids(CTX, 6))
    engine.end_sequence(b.slot)
    assert not b.hit and _compressions(engine) == 2 and engine.cache.pool.in_use == 0


def test_bad_fork_requests_refused(model):
    engine = Engine(model, prefill_chunk_size=32)
    ctx = _ids(40, 7)
    with pytest.raises(ValueError, match="no such live sequence"):
        engine.serve([Request(ctx + [5], 2, fork_of=99, fork_tokens=40)])
    pre = engine.prefill_context(ctx)
    with pytest.raises(ValueError, match="fork_tokens"):
        engine.serve([Request(ctx, 2, fork_of=pre.slot, fork_tokens=40)])
    engine.end_sequence(pre.slot)


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_forks_preempted_by_recompute_fork_again(model, schedule):
    """A pool that holds the context and about one fork: the forks preempt each other (recompute), come back as
    forks of the same context and still give independent generations' tokens."""
    ctx, qs = _ids(CTX, 8), _questions()
    engine = Engine(model, prefill_chunk_size=32, prefix_caching=False, num_blocks=40 + 20, schedule=schedule,
                    admission_watermark=0.0)
    pre = engine.prefill_context(ctx)
    reqs = [Request(ctx + q, 24, fork_of=pre.slot, fork_tokens=len(ctx), uncompressed_tail=len(q)) for q in qs]
    out = engine.serve(reqs)
    engine.end_sequence(pre.slot)
    assert out.preemptions > 0 and all(r.finish_reason == "length" for r in out.requests)
    alone = Engine(model, prefill_chunk_size=32, prefix_caching=False)
    for r, q in zip(out.requests, qs):
        assert r.output == alone.generate([ctx + q], max_new_tokens=24)[0].token_ids
    assert engine.cache.pool.in_use == 0
