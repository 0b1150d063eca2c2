"""Speculative decoding over the paged pool (kvbench.runtime.serving.speculative), swap-out preemption
(kvbench.runtime.cache.swap) and the rollback they rest on, on a tiny random Llama.

Lossless: greedy outputs with speculation equal those without it, token for token, for every registered method as
the drafter, every codec as the target's storage, one sequence and a continuous-batching trace whose pool forces
preemptions (recompute, swap, auto). Rejection sampling keeps the target's distribution (a statistical test on a
five-token vocabulary). Rollback frees exactly what it should (block tables, positions and the free list after every
round of scripted rejections; the pool back where it started at the end). Swap restores blocks bit for bit, and the
byte counts are the blocks moved times their bytes.
"""
from __future__ import annotations

import pytest
import torch

import kvbench.runtime.serving.speculative as speculative
from kvbench.methods import available_methods, build_method
from kvbench.runtime.cache.swap import SwapSpace, should_swap
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.requests import Request
from kvbench.runtime.serving.speculative import SpeculativeDecoder, rejection_sample
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.variants import VARIANTS, knobs
from tests.runtime.test_ragged import CODECS  # every codec (kvquant with uniform levels: no calibration)
from tests.tiny_models import ByteTokenizer, tiny_model

BS = 8
NEW = 16
one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, max_positions=1024, tokenizer=ByteTokenizer(256))


def _prompts(lengths=(70, 45, 101), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, method=None, codec=None, num_blocks=4096, **kw):
    return Engine(model, method, codec=codec, block_size=BS, num_blocks=num_blocks, prefill_chunk_size=32,
                  prefix_caching=False, **kw)


def _speculative(model, draft_method, k=3, adaptive=True, draft_codec=None):
    """A decoder whose draft engine runs draft_method (for a target engine's `speculator` argument)."""
    return SpeculativeDecoder(_engine(model, draft_method, draft_codec), k, adaptive=adaptive)


@pytest.fixture(scope="module")
def reference(model):
    """Greedy outputs without speculation: one prompt alone, and three through the scheduler."""
    one = [g.token_ids for g in _engine(model).generate(_prompts()[:1], max_new_tokens=NEW)]
    three = [g.token_ids for g in _engine(model).generate(_prompts(), max_new_tokens=NEW)]
    return one, three


# one variant per registered method (the method matrix's first, its options made for these tiny models)
DRAFTERS = {}
for _name, _opts in VARIANTS:
    DRAFTERS.setdefault(_name, _opts)


def test_every_method_drafts():
    assert set(DRAFTERS) == set(available_methods())


@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_greedy_output_is_the_targets_for_every_drafter(model, reference, name):
    spec = _speculative(model, build_method(name, **knobs(name, None if name == "full" else 32), **DRAFTERS[name]))
    target = _engine(model, speculator=spec)
    free = target.cache.pool.num_free
    one = [g.token_ids for g in target.generate(_prompts()[:1], max_new_tokens=NEW)]
    three = [g.token_ids for g in target.generate(_prompts(), max_new_tokens=NEW)]
    assert (one, three) == reference
    assert spec.stats.draft_tokens > 0 and spec.stats.rounds > 0
    assert target.cache.pool.num_free == free  # every block back, the rejected drafts' included
    assert spec.draft.cache.pool.num_free == spec.draft.cache.pool.capacity and not spec.draft.cache.live
    target.cache.pool.check_consistency()


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_greedy_output_is_the_targets_for_every_codec_target(model, codec):
    prompts = _prompts()
    plain = [g.token_ids for g in _engine(model, codec=CODECS[codec]()).generate(prompts, max_new_tokens=NEW)]
    spec = _speculative(model, build_method("streaming_llm", 32), k=4)
    target = _engine(model, codec=CODECS[codec](), speculator=spec)
    assert [g.token_ids for g in target.generate(prompts, max_new_tokens=NEW)] == plain
    assert spec.stats.rounds > 0


@pytest.mark.parametrize("preemption", ["recompute", "swap", "auto"])
def test_continuous_batching_with_preemption_is_lossless(model, reference, preemption):
    # 3 sequences in a pool that holds about 2: the newest is preempted while the others decode
    spec = _speculative(model, build_method("streaming_llm", 32), k=3)
    target = _engine(model, num_blocks=2 * 16 * 4 + 8, speculator=spec, preemption=preemption, swap_bytes=1 << 30)
    free = target.cache.pool.num_free
    out = target.serve([Request(p, NEW) for p in _prompts()])
    assert [r.output for r in out.requests] == reference[1]
    assert out.preemptions > 0
    if preemption == "swap":
        assert out.swap_preemptions == out.preemptions
    if preemption != "recompute":
        sw = target.swap
        assert out.swap["swap_out_bytes"] == sw.blocks_out * target.cache.bytes_per_block > 0
        assert sw.bytes_in == sw.bytes_out and sw.used_bytes == 0  # every swapped sequence came back
    assert target.cache.pool.num_free == free and spec.draft.cache.pool.num_free == spec.draft.cache.pool.capacity


def test_swap_without_speculation_gives_the_same_outputs(model, reference):
    outs = {}
    for mode in ("recompute", "swap", "auto"):
        eng = _engine(model, num_blocks=2 * 16 * 4 + 8, preemption=mode, swap_bytes=1 << 30)
        o = eng.serve([Request(p, NEW) for p in _prompts()])
        assert o.preemptions > 0
        outs[mode] = [r.output for r in o.requests]
    assert outs["recompute"] == outs["swap"] == outs["auto"] == reference[1]


@pytest.mark.parametrize("codec", [None, "kivi2"])
def test_swap_restores_blocks_bit_for_bit(model, codec):
    eng = _engine(model, codec=CODECS[codec]() if codec else None)
    c = eng.cache
    slots = [eng.new_sequence() for _ in range(2)]
    for s, p in zip(slots, _prompts((70, 53))):
        eng.forward_chunk(s, p, 0)
    if codec:
        c.pack_pending()
    before = [c.gather(layer, slots[0]) for layer in range(c.num_layers)]
    tables = c.tables[slots[0]].clone()
    swap = SwapSpace(c, 1 << 30)
    held = c.blocks_held(slots[0])
    ids = tables[torch.arange(tables.shape[-1]) < c._num_blocks(c.lengths[slots[0]]).unsqueeze(-1)].tolist()
    free = c.pool.num_free
    moved = swap.swap_out(slots[0])
    assert c.pool.num_free == free + held and c.blocks_held(slots[0]) == 0
    assert moved == swap.bytes_out == c.block_payload_bytes(ids) and swap.blocks_out == held == len(ids)
    eng.forward_chunk(slots[1], _prompts((40,), seed=3)[0], 53)  # other writes reuse the freed blocks
    swap.swap_in(slots[0])
    after = [c.gather(layer, slots[0]) for layer in range(c.num_layers)]
    for (k0, v0, p0), (k1, v1, p1) in zip(before, after):
        assert torch.equal(k0, k1) and torch.equal(v0, v1) and torch.equal(p0, p1)
    assert swap.bytes_in == swap.bytes_out == moved and swap.blocks_in == held
    if codec is None:
        assert moved == held * c.bytes_per_block
    c.pool.check_consistency()


def test_rollback_frees_exactly_what_it_should(model, monkeypatch):
    """Scripted acceptances (0..k, all rejected to all accepted): after every round, each target table holds exactly
    the tokens so far but the newest, at positions 0..n-1, the draft's the same or one fewer, and the pool's free
    list is what those tables need; at the end both pools are as they started."""
    script = iter([0, 3, 1, 0, 2, 3, 0, 1] * 8)

    def scripted(logits, drafts):
        a = min(next(script), len(drafts))
        return drafts[:a] + [int(logits[a].argmax())]

    monkeypatch.setattr(speculative, "greedy_accept", scripted)
    spec = _speculative(model, build_method("streaming_llm", 40), k=3, adaptive=False)
    target = _engine(model, speculator=spec)
    c, d = target.cache, spec.draft.cache
    free_t, free_d = c.pool.num_free, d.pool.num_free
    L, H = c.num_layers, c.num_kv_heads
    prompt = _prompts((37,))[0]
    slot = target.new_sequence()
    logits = target.forward_chunk(slot, prompt, 0)
    spec.follow_prefill([(slot, prompt, 0, True)])
    tokens = prompt + [int(logits[0].argmax())]
    for _ in range(12):
        (emitted,) = spec.decode(target, [(slot, list(tokens), 1 << 30)], 0.0, 1.0, torch.Generator())
        tokens += emitted
        n = len(tokens) - 1
        assert bool((c.lengths[slot] == n).all())
        assert torch.equal(c.positions[slot, :, :, :n], torch.arange(n, dtype=torch.int32).expand(L, H, n))
        assert c.pool.in_use == L * H * -(-n // BS)
        ds = spec._seqs[slot]
        assert ds.fed in (n - 1, n) and bool((d.lengths[ds.slot] <= 40 + BS - 1).all())  # a block-wise window
        assert int(d.positions[ds.slot, :, :, : int(d.lengths[ds.slot].max())].max()) == ds.fed - 1
        assert d.pool.in_use == int(d._num_blocks(d.lengths[ds.slot]).sum())
        c.pool.check_consistency()
        d.pool.check_consistency()
    assert spec.stats.accepted_tokens < spec.stats.draft_tokens
    target.end_sequence(slot)
    assert c.pool.num_free == free_t and d.pool.num_free == free_d


def test_truncate_needs_the_newest_slots(model):
    eng = _engine(model)
    s = eng.new_sequence()
    eng.forward_chunk(s, _prompts((30,))[0], 0)
    assert eng.cache.truncate(s, 30) == 0
    freed = eng.cache.truncate(s, 17)  # 30 -> 17 tokens: blocks 3 (24..29) go, block 2 keeps 16
    assert freed == eng.cache.num_layers * eng.cache.num_kv_heads
    assert bool((eng.cache.lengths[s] == 17).all()) and eng.cache.tokens_seen[s] == 17


def test_rejection_sampling_keeps_the_target_distribution():
    """Five tokens; p (target) and q (draft) far apart. The first emitted token is distributed as p[0] and, when the
    first draft was accepted, the second as p[1] (Leviathan et al.); 8,000 draws, 6 sigma bounds."""
    g = torch.Generator().manual_seed(1)
    V, n, k = 5, 8_000, 2
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1)
    first = torch.zeros(V)
    second, n2 = torch.zeros(V), 0
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
        out = rejection_sample(p, q, drafts, g)
        assert 1 <= len(out) <= k + 1 and out[:-1] == drafts[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
            n2 += 1
    for counts, total, want in ((first, n, p[0]), (second, n2, p[1])):
        freq = counts / total
        sigma = (want * (1 - want) / total).sqrt()
        assert bool(((freq - want).abs() <= 6 * sigma + 1e-3).all()), (freq, want)


def test_sampling_through_the_engine_runs_and_frees(model):
    spec = _speculative(model, build_method("streaming_llm", 32), k=3)
    target = _engine(model, speculator=spec)
    gens = target.generate(_prompts(), max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=3)
    assert all(len(g.token_ids) == NEW for g in gens)
    assert spec.stats.draft_tokens > 0 and not target.cache.live and not spec.draft.cache.live


def test_auto_rule():
    assert should_swap("swap", 10**9, 1, 1.0, 1.0) and not should_swap("recompute", 1, 10**6, 1e9, 1.0)
    # 1 MB out and back at 1 GB/s = 2 ms; 4,096 tokens at 400 tok/s = 10 s: swap. 100 tokens at 1e6 tok/s: recompute
    assert should_swap("auto", 10**6, 4096, 1e9, 400.0)
    assert not should_swap("auto", 10**6, 100, 1e9, 1e6)


def test_a_throughput_run_records_speculation_swap_and_pool_health(tmp_path):
    """task=throughput through app.run with speculation and swap preemption on a pool that holds about two of the
    three prompts: metrics.json has the acceptance figures, the draft's peak beside the target's, the pool's health
    and swap byte counts equal to the timeline's last row; the summary shows both lines."""
    import csv
    import os

    from kvbench.run import app
    from kvbench.reporting.summary import format_summary
    from tests.fixtures.task_fixtures import run_cfg, tiny_loader

    cfg = run_cfg(tmp_path, ["task=throughput", "task.num_requests=3", "task.input_tokens=[60,80]",
                             "task.output_tokens=[8,10]", "runtime.block_size=8", "runtime.num_blocks=121",
                             "runtime.speculative.num_tokens=3", "runtime.speculative.budget=32",
                             "runtime.preemption=swap"])
    rec = app.run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec.get("error")
    assert rec["completed_requests"] == 3 and rec["draft_tokens"] > 0
    assert 0 <= rec["acceptance_rate"] <= 1 and rec["mean_accepted_tokens"] >= 0
    assert 0 < rec["draft_peak_kv_bytes"] and 0 < rec["peak_kv_bytes"]
    assert 0 < rec["pool_usage_pct_mean"] <= rec["pool_usage_pct_p95"] <= 100
    assert rec["blocks_per_request_mean"] > 0 and rec["prefix_cache_hit_rate"] == 0
    assert rec["preemptions"] > 0 and rec["swap_preemptions"] == rec["preemptions"]
    assert rec["preemptions_per_min"] > 0
    assert rec["swap_out_bytes"] == rec["swap_in_bytes"] == rec["swap_out_blocks"] * 2 * 8 * 16 * 4 > 0
    rows = list(csv.DictReader(open(os.path.join(rec["run_dir"], "timeline.csv"))))
    assert int(rows[-1]["swap_out_bytes"]) == rec["swap_out_bytes"]
    assert int(rows[-1]["preemptions"]) == rec["preemptions"]
    assert sum(int(r["emitted"]) for r in rows) == rec["output_tokens"]
    text = format_summary(rec)
    assert "speculate k=3, draft streaming_llm@32" in text and "pool      usage mean" in text


@pytest.mark.parametrize("name", ["streaming_llm", "paged_eviction"])
def test_a_draft_that_keeps_every_token_is_always_accepted(model, name):
    """At a budget above every sequence's length the draft cache is the target's: acceptance 100%."""
    spec = _speculative(model, build_method(name, 512), k=4, adaptive=False)
    target = _engine(model, speculator=spec)
    target.generate(_prompts(), max_new_tokens=NEW)
    assert spec.stats.as_metrics()["acceptance_rate"] == 1.0
