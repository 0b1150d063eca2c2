"""The continuous-batching scheduler: property tests over random traces, methods and tiny pools."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.methods import build_method
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scheduler import Request, Scheduler
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import SMOLLM2_TOKEN_IDS, tiny_model

BS = 8
METHODS = [("full", None, {}), ("paged_eviction", 32, {}), ("streaming_llm", 24, {}), ("h2o", 24, {}),
           ("snapkv", 24, {"window": 8}), ("snapkv", 24, {"window": 8, "decode": "window"}),
           ("key_diff", 32, {"decode": "none"}), ("kvcrush", 24, {"prefill_mode": "streaming"})]


one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    """A 2-layer random Llama over 256 tokens (2 kv-heads of 4 query heads)."""
    return _tiny_model()


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def check_block_references(cache):
    """Every block a live table names is in use with exactly as many references as tables naming it (so no block
    is freed, or handed out again, while a sequence still references it), and nothing else is in use."""
    refs = {}
    for s in cache.live:
        nb = (cache.lengths[s] + cache.block_size - 1) // cache.block_size  # [L, H]
        for layer in range(cache.num_layers):
            for h in range(cache.num_kv_heads):
                for b in cache.tables[s, layer, h, : int(nb[layer, h])].tolist():
                    refs[b] = refs.get(b, 0) + 1
    for b, n in refs.items():
        assert cache.pool.refcount(b) == n, f"block {b}: {n} table references, refcount {cache.pool.refcount(b)}"
    assert cache.pool.in_use == len(refs)
    cache.pool.check_consistency()


def _checked_serve(engine, reqs, **kw):
    """serve() with the pool's invariants checked after every generated token."""
    return engine.serve(reqs, on_token=lambda _r: check_block_references(engine.cache), **kw)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(4, 90), min_size=1, max_size=7), new=st.integers(1, 24),
       method=st.sampled_from(METHODS), pool=st.integers(18, 120), chunk=st.sampled_from([8, 16, 64]),
       seed=st.integers(0, 10))
def test_every_request_finishes_or_fails_alone_and_the_pool_empties(model, lengths, new, method, pool, chunk, seed):
    name, budget, opts = method
    engine = Engine(model, build_method(name, budget, **opts), block_size=BS, num_blocks=pool,
                    prefill_chunk_size=chunk, admission_watermark=0.05)
    reqs = [Request(p, new) for p in _prompts(lengths, seed)]
    out = _checked_serve(engine, reqs)
    for r in reqs:
        assert r.status in ("finished", "failed")
        if r.status == "finished":
            assert len(r.output) == new and r.first_token_s is not None and r.finish_s >= r.first_token_s
        else:
            assert "does not fit" in r.error and "KV blocks" in r.error and r.output is not None
    assert engine.cache.pool.in_use == 0 and not engine.cache.live
    engine.cache.pool.check_consistency()
    assert not getattr(engine.method, "_state", {}), "method state left behind"
    if any(r.status == "finished" for r in reqs):  # a request too large for the pool fails before it is admitted
        assert out.max_running >= 1 and len(out.timeline) > 0


def _shared_prefix_prompts(lengths, seed, shared):
    """Prompts whose first `shared` tokens are the same (prefix caching has something to share)."""
    prompts = _prompts(lengths, seed)
    head = prompts[0][:shared]
    return [head + p[len(head):] if len(p) > shared else p for p in prompts]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(10, 70), min_size=2, max_size=6), new=st.integers(2, 20),
       seed=st.integers(0, 5), schedule=st.sampled_from(["mixed", "prefill_first"]),
       prefix=st.sampled_from(["auto", False]), shared=st.sampled_from([0, 9, 24, 40]),
       budget=st.sampled_from([8, 24, 2048]))
def test_full_cache_outputs_equal_batch_one_generate_even_when_preempted(model, lengths, new, seed, schedule,
                                                                         prefix, shared, budget):
    prompts = _shared_prefix_prompts(lengths, seed, shared)
    ref = Engine(model, block_size=BS, num_blocks=4096, prefix_caching=False)
    want = [ref.generate([p], max_new_tokens=new)[0].token_ids for p in prompts]
    # a pool that holds the longest request alone, so every request fits but not all at once
    need = -(-(max(lengths) + new) // BS) * model.config.num_layers * model.config.num_kv_heads
    engine = Engine(model, block_size=BS, num_blocks=need + 2, prefill_chunk_size=16, schedule=schedule,
                    prefix_caching=prefix, max_num_batched_tokens=budget)
    reqs = [Request(p, new) for p in prompts]
    _checked_serve(engine, reqs)
    assert [r.output for r in reqs] == want
    assert all(r.status == "finished" for r in reqs)


@pytest.mark.parametrize("schedule,budget", [("mixed", 16), ("mixed", 2048), ("prefill_first", 16)])
def test_full_cache_with_prefix_caching_shares_and_equals_generate(model, schedule, budget):
    """A roomy pool: every request runs at once, the prompts share 40 tokens (5 blocks), and the shared blocks
    are taken from the cache instead of prefilled (with a budget that would admit every prompt in the first step,
    the later ones wait for the blocks the first is computing); outputs equal batch-1 generate."""
    prompts = _shared_prefix_prompts([60, 52, 70, 45], 11, 40)
    ref = Engine(model, block_size=BS, num_blocks=4096, prefix_caching=False)
    want = [ref.generate([p], max_new_tokens=12)[0].token_ids for p in prompts]
    engine = Engine(model, block_size=BS, num_blocks=4096, prefill_chunk_size=16, schedule=schedule,
                    max_num_batched_tokens=budget)
    assert engine.prefix_cache is not None  # auto: on for full
    reqs = [Request(p, 12) for p in prompts]
    out = _checked_serve(engine, reqs)
    assert [r.output for r in reqs] == want
    assert out.cached_prompt_tokens == 3 * 40  # the three later requests each take the 5 shared blocks
    assert sum(r.prefill_tokens for r in reqs) == sum(map(len, prompts)) - 3 * 40
    assert engine.cache.pool.in_use == 0
    assert_only_cached_free_blocks_are_named(engine)


def assert_only_cached_free_blocks_are_named(engine):
    """After a trace: every prefix-cache entry left names blocks that sit free and cached in the pool, and every
    cached free block is named by an entry (none is lost to the free count)."""
    pool, pc = engine.cache.pool, engine.prefix_cache
    named = {b for ids in pc._entries.values() for b in ids.flatten().tolist()}
    assert all(pool.is_cached_free(b) for b in named)
    assert pool.num_cached_free == len(named)


def test_a_finished_prompt_stays_cached_for_a_later_request(model):
    """vLLM's cached free blocks: a request's prompt blocks outlive it, so the same prompt served later is taken
    from the cache (all but its last block's worth), with outputs equal to batch-1 generate; the cached blocks count
    as free, and a trace that needs the room evicts them."""
    prompt = _prompts([45], 4)[0]
    ref = Engine(model, block_size=BS, num_blocks=4096, prefix_caching=False)
    want = ref.generate([prompt], max_new_tokens=6)[0].token_ids
    engine = Engine(model, block_size=BS, num_blocks=200, prefill_chunk_size=16)
    first = [Request(prompt, 6)]
    _checked_serve(engine, first)
    assert engine.cache.pool.in_use == 0 and engine.cache.pool.num_cached_free > 0
    again = [Request(prompt, 6)]
    out = _checked_serve(engine, again)
    assert out.cached_prompt_tokens == (len(prompt) - 1) // BS * BS  # every full block but the last token's
    assert first[0].output == again[0].output == want
    assert_only_cached_free_blocks_are_named(engine)
    # prompts that fill the pool evict the cached blocks and still equal generate
    big = _prompts([90, 85], 6)
    reqs = [Request(p, 4) for p in big]
    _checked_serve(engine, reqs)
    assert [r.output for r in reqs] == [ref.generate([p], max_new_tokens=4)[0].token_ids for p in big]
    assert_only_cached_free_blocks_are_named(engine)


_PREEMPTING = {  # (prompt lengths, new tokens): prompts fit together, their growth does not
    "prefill_first": ([60, 64, 58, 62], 40),
    "mixed": ([16, 14, 15, 16], 60),
}


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_preemption_happens_and_recomputes(model, schedule):
    lengths, new = _PREEMPTING[schedule]
    prompts = _prompts(lengths, 3)
    need = -(-(max(lengths) + new) // BS) * 2 * 2
    engine = Engine(model, block_size=BS, num_blocks=need + 12, prefill_chunk_size=16, admission_watermark=0,
                    schedule=schedule)
    reqs = [Request(p, new) for p in prompts]
    out = _checked_serve(engine, reqs)
    ref = Engine(model, block_size=BS, num_blocks=4096)
    assert out.preemptions > 0 and sum(r.preemptions for r in reqs) == out.preemptions
    assert [r.output for r in reqs] == [ref.generate([p], max_new_tokens=new)[0].token_ids for p in prompts]
    preempted = [r for r in reqs if r.preemptions]
    assert all(r.prefill_tokens > len(r.prompt) for r in preempted)  # prompt + generated tokens recomputed


def test_a_request_that_can_never_fit_fails_alone(model):
    prompts = _prompts([30, 400, 20], 1)
    engine = Engine(model, block_size=BS, num_blocks=60, prefill_chunk_size=32)
    gens = engine.generate(prompts, max_new_tokens=5)
    assert [g.finish_reason for g in gens] == ["length", "failed", "length"]
    assert "request 1 does not fit: its 400 tokens need 200 KV blocks, the whole pool holds 59" in gens[1].error
    assert engine.cache.pool.in_use == 0
    # a method that evicts during prefill (streaming) holds the same prompt in the same pool
    engine = Engine(model, build_method("streaming_llm", 24), block_size=BS, num_blocks=60, prefill_chunk_size=32)
    assert all(g.finish_reason == "length" for g in engine.generate(prompts, max_new_tokens=5))


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_compression_admits_more_sequences_into_the_same_pool(model, schedule):
    prompts = _prompts([200] * 16, 2)
    runs = {}
    for name, budget in (("full", None), ("paged_eviction", 32)):
        engine = Engine(model, build_method(name, budget), block_size=BS, num_blocks=420, prefill_chunk_size=64,
                        schedule=schedule)
        reqs = [Request(p, 16, ignore_eos=True) for p in prompts]
        runs[name] = engine.serve(reqs)
        assert all(r.status == "finished" for r in reqs)
    assert runs["paged_eviction"].max_running >= 3 * runs["full"].max_running


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_arrivals_limits_and_timeline(model, schedule):
    prompts = _prompts([20, 30, 25, 40], 4)
    engine = Engine(model, block_size=BS, num_blocks=4096, max_num_seqs=2, max_num_batched_tokens=16,
                    schedule=schedule)
    reqs = [Request(p, 6, arrival_s=0.05 * i) for i, p in enumerate(prompts)]
    out = engine.serve(reqs)
    assert out.max_running <= 2
    assert all(s.tokens <= 16 for s in out.timeline)
    assert all(r.first_token_s >= r.arrival_s for r in reqs)
    kinds = {s.kind for s in out.timeline}
    assert kinds == {"prefill", "decode"} if schedule == "prefill_first" else kinds <= {"prefill", "decode", "mixed"}
    assert [s.t_s for s in out.timeline] == sorted(s.t_s for s in out.timeline)


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_a_compressing_method_shares_a_prefix_then_owns_its_copy(model, schedule, monkeypatch):
    """prefix_caching=true with PagedEviction: later requests take the first prompt's cached blocks, then compress
    their own prompt (copy-on-write: the shared blocks they change become private, the donor's stay intact);
    everyone's tokens equal a run without sharing, and block references stay exact throughout."""
    prompts = _shared_prefix_prompts([70, 66, 75], 5, 48)
    solo = Engine(model, build_method("paged_eviction", 32), block_size=BS, num_blocks=4096, prefix_caching=False)
    want = [solo.generate([p], max_new_tokens=10)[0].token_ids for p in prompts]
    engine = Engine(model, build_method("paged_eviction", 32), block_size=BS, num_blocks=4096, prefill_chunk_size=16,
                    schedule=schedule, max_num_batched_tokens=16, prefix_caching=True)
    copied = []
    unshare = type(engine.cache)._unshare_table

    def counting_unshare(cache, table, lengths, only=None):
        free = cache.pool.num_free
        unshare(cache, table, lengths, only)
        copied.append(free - cache.pool.num_free)

    monkeypatch.setattr(type(engine.cache), "_unshare_table", counting_unshare)
    reqs = [Request(p, 10) for p in prompts]
    out = _checked_serve(engine, reqs)
    assert out.cached_prompt_tokens > 0
    if schedule == "mixed":  # the next prompt is admitted while the first still prefills: it shares blocks that
        assert sum(copied) > 0  # the first has not compacted yet, and copies them before compacting its own
    # (prefill_first compresses the first prompt before admitting the next: its compacted blocks are never offered)
    assert [r.output for r in reqs] == want
    assert engine.cache.pool.in_use == 0


def test_prefix_caching_settings():
    assert Engine(_tiny_model(), prefix_caching="auto").prefix_cache is not None  # full: on
    assert Engine(_tiny_model(), build_method("snapkv", 24)).prefix_cache is None  # acts after attention: off
    assert Engine(_tiny_model(), build_method("snapkv", 24), prefix_caching=True).prefix_cache is not None
    with pytest.raises(ValueError, match="h2o.*accumulates attention"):
        Engine(_tiny_model(), build_method("h2o", 24), prefix_caching=True)
    with pytest.raises(ValueError, match="schedule 'fifo'"):
        Engine(_tiny_model(), schedule="fifo")


def _tiny_model():
    return tiny_model(vocab=256, max_positions=1024, **SMOLLM2_TOKEN_IDS)


@pytest.mark.parametrize("key,value", [("schedule", "fifo"), ("prefix_caching", "yes")])
def test_bad_runtime_scheduler_settings_are_one_line_user_errors(key, value):
    from kvbench.run.config import RuntimeConfig
    from kvbench.errors import UserError

    with pytest.raises(UserError, match=f"invalid runtime.{key}={value!r}: choices are"):
        RuntimeConfig(**{key: value})


def test_a_codec_cache_shares_prefix_blocks_packed_once(model):
    """KIVI under prefix caching (auto: on): later prompts take the first one's cached blocks, which are packed once
    and stay shared (one packed block, several tables); references stay exact at every token and the pool empties."""
    from kvbench.quant.codecs import KiviCodec

    prompts = _shared_prefix_prompts([90, 84, 96], 7, 64)
    engine = Engine(model, codec=KiviCodec(2, group_size=8, residual=16), block_size=BS, num_blocks=4096,
                    prefill_chunk_size=16, max_num_batched_tokens=2048)
    assert engine.prefix_cache is not None
    cache = engine.cache
    shared_packed = []

    def check(_req):
        check_block_references(cache)
        ids = []
        for s in cache.live:
            nb = ((cache.lengths[s] + cache.block_size - 1) // cache.block_size).tolist()  # [L][H] in use
            rows = cache.tables[s].tolist()
            ids += [b for li, row_l in enumerate(rows) for h, row in enumerate(row_l) for b in row[: nb[li][h]]
                    if b >= cache.num_fp_blocks]
        shared_packed.append(sum(1 for b in set(ids) if cache.pool.refcount(b) > 1))

    reqs = [Request(p, 12) for p in prompts]
    out = engine.serve(reqs, on_token=check)
    assert all(r.status == "finished" and len(r.output) == 12 for r in reqs)
    assert out.cached_prompt_tokens == 2 * 64
    assert max(shared_packed) > 0
    assert cache.pool.in_use == 0 and len(engine.prefix_cache) == 0


@pytest.mark.parametrize("schedule", ["mixed", "prefill_first"])
def test_prefix_caching_with_preemption_equals_generate(model, schedule):
    """Shared prompt blocks and preemption together (full, greedy): sequences that took cached blocks are preempted
    and recomputed (taking the cache again where it still holds), and every output equals batch-1 generate."""
    prompts = _shared_prefix_prompts([24, 22, 23, 24], 9, 16)
    new = 60
    need = -(-(24 + new) // BS) * 2 * 2
    engine = Engine(model, block_size=BS, num_blocks=need + 16, prefill_chunk_size=16, admission_watermark=0,
                    schedule=schedule)
    reqs = [Request(p, new) for p in prompts]
    out = _checked_serve(engine, reqs)
    ref = Engine(model, block_size=BS, num_blocks=4096, prefix_caching=False)
    assert out.preemptions > 0 and out.cached_prompt_tokens > 0
    assert [r.output for r in reqs] == [ref.generate([p], max_new_tokens=new)[0].token_ids for p in prompts]
    assert engine.cache.pool.in_use == 0
    assert_only_cached_free_blocks_are_named(engine)


def test_a_preempted_request_takes_its_own_cached_blocks_back(model):
    """Preemption by recompute with prefix caching: the victim's computed blocks stay cached in the pool, so on
    re-admission it takes the ones not evicted meanwhile instead of prefilling its prompt again; outputs equal
    batch-1 generate. Without the cache the same trace recomputes every preempted prompt in full."""
    lengths, new = [16, 14, 15, 16], 60
    prompts = _prompts(lengths, 3)
    need = -(-(max(lengths) + new) // BS) * 2 * 2
    runs = {}
    for caching in (False, True):
        engine = Engine(model, block_size=BS, num_blocks=need + 12, prefill_chunk_size=16, admission_watermark=0,
                        prefix_caching=caching)
        reqs = [Request(p, new) for p in prompts]
        out = _checked_serve(engine, reqs)
        runs[caching] = (out, reqs)
    ref = Engine(model, block_size=BS, num_blocks=4096, prefix_caching=False)
    want = [ref.generate([p], max_new_tokens=new)[0].token_ids for p in prompts]
    for out, reqs in runs.values():
        assert out.preemptions > 0 and [r.output for r in reqs] == want
    (off, off_reqs), (on, on_reqs) = runs[False], runs[True]
    assert off.cached_prompt_tokens == 0
    assert on.cached_prompt_tokens > 0  # the prompts share nothing: these are victims' own blocks
    assert sum(r.prefill_tokens for r in on_reqs) < sum(r.prefill_tokens for r in off_reqs)


def test_the_scheduler_only_plans_steps():
    """Driven by hand, with no model and no engine (schedule -> run -> postprocess with the run left out): prompts
    are admitted in chunks, decode tokens come first once a prompt is in, and the sampled tokens it is given finish
    each request, whose sequence it ends through the callback."""
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, num_blocks=64, max_seqs=4)
    ended = []
    sched = Scheduler(cache, lambda slot: (ended.append(slot), cache.free_sequence(slot)), chunk_size=3,
                      max_num_batched_tokens=8)
    reqs = [Request([1, 2, 3, 4, 5], 2), Request([6, 7], 3)]
    sched.add(reqs)
    steps = []
    while sched.has_unfinished():
        batch = sched.schedule()
        steps.append([(sc.req.index, sc.kind, sc.n, sc.emits) for sc in batch])
        sched.postprocess(batch, {i: 9 for i, sc in enumerate(batch) if sc.emits}, 0.0)
    assert steps[:2] == [[(0, "prefill", 3, False), (1, "prefill", 2, True)],
                         [(1, "decode", 1, True), (0, "prefill", 2, True)]]
    assert [r.output for r in reqs] == [[9, 9], [9, 9, 9]] and [r.finish_reason for r in reqs] == ["length"] * 2
    assert sorted(ended) == [0, 1] and not cache.live and len(sched.outcome().timeline) == len(steps)
