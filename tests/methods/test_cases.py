"""Hand-made K/V cases where the right answer is known, on a bare PagedKVCache (one layer; PagedEviction's own:
tests/methods/test_paged_eviction.py)."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.methods.kvcrush import hamming_order, spread_picks, top_half_bits
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.hooks import LayerContext
from tests.methods.bare_cache import assert_blocks_consistent, coded, make_cache, positions, step


# ------------------------------------------------------------------------------ StreamingLLM
@pytest.mark.parametrize("sinks,bs", [(4, 4), (4, 8), (6, 4), (0, 4), (8, 4)])
def test_streaming_llm_keeps_sinks_and_last_window(sinks, bs):
    W = 10
    cache = make_cache(bs=bs)
    m = build_method("streaming_llm", sinks + W, sinks=sinks)
    m.attach(cache, None)
    slot = cache.add_sequence()
    k, v = coded(range(30))
    step(m, cache, slot, k, v, 0, "prefill")
    assert positions(cache, slot) == list(range(sinks)) + list(range(30 - W, 30))
    for t in range(30, 30 + 5 * bs):  # decode: one token per step
        before = cache.tables[slot, 0, 0].clone()
        n_before = int(cache.lengths[slot, 0, 0])
        k, v = coded([t])
        step(m, cache, slot, k, v, t, "decode")
        pos = positions(cache, slot)
        window = pos[sinks:]
        assert pos[:sinks] == list(range(sinks))
        assert window == list(range(t + 1 - len(window), t + 1))  # the most recent tokens, contiguous
        assert W <= len(window) <= W + bs - 1  # whole blocks leave: over by at most the filling block
        # K/V moved along with their positions
        kk, vv, kp = cache.gather(0, slot)
        assert torch.equal(kk[:, :, 0], kp.float()) and torch.equal(vv[:, :, 0], -kp.float())
        if len(pos) < n_before + 1:  # a block left: only the block holding the sinks' tail was rewritten
            a = sinks // bs
            nb = -(-len(pos) // bs)
            assert n_before + 1 - len(pos) == bs
            assert torch.equal(cache.tables[slot, 0, 0, a + 1: nb], before[a + 2: nb + 1])
        assert_blocks_consistent(cache)
    cache.free_sequence(slot)
    m.on_sequence_end(slot)
    assert cache.pool.in_use == 0


def test_streaming_llm_reindex_mode_stores_pre_rope_keys():
    m = build_method("streaming_llm", 64, position_mode="reindex")
    assert m.store_pre_rope and m.rope_mode == "cache"
    m = build_method("streaming_llm", 64)
    assert not m.store_pre_rope and m.rope_mode == "original"
    assert m.describe()["window"] == 60 and m.describe()["prefill_mode"] == "streaming"


# ------------------------------------------------------------------------------ KeyDiff
def test_key_diff_keeps_keys_unlike_the_others():
    g = torch.Generator().manual_seed(0)
    k = torch.zeros(2, 16, 4)
    k[..., 0] = 1.0
    k[..., 1] = 0.05 * torch.rand(2, 16, generator=g)
    outliers = [2, 6, 11, 13]
    k[:, outliers] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    v = torch.randn(2, 16, 4, generator=g)
    cache = make_cache(bs=4)
    m = build_method("key_diff", 8)
    m.attach(cache, None)
    slot = cache.add_sequence()
    step(m, cache, slot, k, v, 0, "prefill")
    for h in range(2):
        pos = positions(cache, slot, h)
        assert len(pos) == 8 and set(outliers) <= set(pos)


# ------------------------------------------------------------------------------ H2O
def test_h2o_keeps_the_keys_that_received_most_attention():
    H, Hq, D, T = 1, 2, 8, 16
    g = torch.Generator().manual_seed(0)
    k = 0.1 * torch.randn(H, T, D, generator=g)
    heavy = [2, 5, 8]
    k[:, heavy, 0] = 8.0
    v = torch.randn(H, T, D, generator=g)
    q = torch.zeros(1, Hq, T, D)
    q[..., 0] = 1.0  # every query looks for the heavy keys
    cache = make_cache(H=H, D=D, bs=4)
    m = build_method("h2o", 6)  # 3 heavy + 3 recent
    slot = cache.add_sequence()
    plan = cache.prepare_append([slot], torch.arange(T)[None])
    cache.write(0, plan, k[None], v[None])
    _, ks = cache.attend(0, q, plan, D ** -0.5, backend=TORCH, return_key_scores=True)
    acc = ks[0].clone()  # [H, T] prompt attention mass per key
    assert set(acc[0, :13].topk(3).indices.tolist()) == set(heavy)
    m.after_attention(LayerContext(0, cache, plan, "prefill", True, q, ks))
    assert positions(cache, slot) == heavy + [13, 14, 15]
    # accumulated scores follow the tokens when the table is compacted
    torch.testing.assert_close(m.state(slot, 0)["scores"], acc[:, heavy + [13, 14, 15]])
    # a decode step: token 13 leaves the recent window and is lighter than the heavy hitters
    k1, v1 = 0.1 * torch.randn(H, 1, D, generator=g), torch.randn(H, 1, D, generator=g)
    step(m, cache, slot, k1, v1, T, "decode", q=q[:, :, :1])
    assert positions(cache, slot) == heavy + [14, 15, 16]
    assert m.state(slot, 0)["scores"].shape == (1, 6)


def test_h2o_heavy_hitters_outside_the_recent_window_by_accumulated_score():
    cache = make_cache(H=2, bs=4)
    m = build_method("h2o", 5, recent_ratio=0.4)  # 2 recent + 3 heavy
    slot = cache.add_sequence()
    k, v = coded(range(10))
    ks = torch.tensor([[9, 1, 8, 2, 7, 3, 0, 0, 100, 100], [0, 9, 0, 8, 0, 7, 6, 0, 100, 100.]])[None]
    step(m, cache, slot, k, v, 0, "prefill", key_scores=ks)
    assert positions(cache, slot, 0) == [0, 2, 4, 8, 9]
    assert positions(cache, slot, 1) == [1, 3, 5, 8, 9]
    assert m.describe()["heavy_tokens"] == 3 and m.describe()["recent_tokens"] == 2


# ------------------------------------------------------------------------------ SnapKV
def test_snapkv_keeps_the_pooled_neighbourhood_of_attended_tokens_and_the_window():
    H, Hq, D, T, w = 1, 2, 8, 40, 4
    g = torch.Generator().manual_seed(0)
    k = 0.01 * torch.randn(H, T, D, generator=g)
    k[:, 10, 0] = 8.0  # the token the observation window attends to
    q = torch.zeros(1, Hq, T, D)
    q[..., 0] = 1.0
    cache = make_cache(H=H, D=D, bs=4)
    m = build_method("snapkv", w + 7, window=w, kernel_size=7, pooling="maxpool", decode="window")
    slot = cache.add_sequence()
    step(m, cache, slot, k, torch.randn(H, T, D, generator=g), 0, "prefill", q=q)
    assert positions(cache, slot) == list(range(7, 14)) + list(range(T - w, T))
    # decode (window mode): the prompt selection stays, the window slides
    for t in range(T, T + 3):
        step(m, cache, slot, torch.zeros(H, 1, D), torch.zeros(H, 1, D), t, "decode", q=q[:, :, :1])
    assert positions(cache, slot) == list(range(7, 14)) + list(range(T + 3 - w, T + 3))


def test_snapkv_window_spans_prefill_chunks():
    """A last chunk shorter than the window still scores with `window` queries (carried over)."""
    H, Hq, D, T, w = 1, 2, 8, 40, 8
    k = torch.zeros(H, T, D)
    k[:, 5, 0] = 8.0
    q = torch.zeros(1, Hq, T, D)
    q[:, :, 32:36, 0] = 1.0  # only queries 32..35 (in the previous chunk) look at token 5
    cache = make_cache(H=H, D=D, bs=4)
    m = build_method("snapkv", w + 1, window=w, kernel_size=1)
    slot = cache.add_sequence()
    step(m, cache, slot, k[:, :36], k[:, :36], 0, "prefill", q=q[:, :, :36], last_chunk=False)
    step(m, cache, slot, k[:, 36:], k[:, 36:], 36, "prefill", q=q[:, :, 36:])
    assert positions(cache, slot) == [5] + list(range(T - w, T))


# ------------------------------------------------------------------------------ KVCrush
def test_kvcrush_representatives_are_spread_over_the_hamming_order():
    # 12 tokens, 2 signature bits; tokens 0, 3, 6, 9 are the important ones (not candidates)
    sig = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 0],
                        [1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 1]], dtype=torch.bool)  # [B=2, T=12]
    cand = torch.ones(1, 12, dtype=torch.bool)
    cand[0, [0, 3, 6, 9]] = False
    order, m = hamming_order(cand, sig, torch.zeros(1, 2, dtype=torch.bool))
    # distance to 00: token 1:0 2:1 4:1 5:0 7:2 8:0 10:1 11:1 -> (dist, slot) order
    assert order[0, :8].tolist() == [1, 5, 8, 2, 4, 10, 11, 7] and int(m[0]) == 8
    picks = spread_picks(order, m, 4)
    assert picks[0].tolist() == [1, 8, 4, 11]  # order positions 0, 2, 4, 6
    dist = {1: 0, 5: 0, 8: 0, 2: 1, 4: 1, 10: 1, 11: 1, 7: 2}
    assert {dist[t] for t in picks[0].tolist()} == {0, 1}  # not only the tokens nearest the anchor
    picks = spread_picks(order, m, 3)
    assert picks[0].tolist() == [1, 8, 10]  # order positions floor(j * 8 / 3) = 0, 2, 5
    # anchor "ones" reverses the distance order
    order, m = hamming_order(cand, sig, torch.ones(1, 2, dtype=torch.bool))
    assert order[0, 0].item() == 7 and order[0, 7].item() == 8
    # fewer candidates than representatives: keep them all
    few = torch.zeros(1, 12, dtype=torch.bool)
    few[0, [2, 4]] = True
    order, m = hamming_order(few, sig, torch.zeros(1, 2, dtype=torch.bool))
    assert spread_picks(order, m, 4)[0].tolist() == [2, 4, -1, -1]


def _crush_reference(scores, budget, r, anchor):
    """Plain-python KVCrush selection (recent share 0) for one layer: keep lists per head."""
    H, T = scores.shape
    n_rep = round(r * budget)
    n_imp = budget - n_rep
    bits = [[0] * T for _ in range(H)]
    for h in range(H):
        for t in sorted(range(T), key=lambda t: -scores[h, t])[: T // 2]:
            bits[h][t] = 1
    out = []
    for h in range(H):
        imp = sorted(range(T), key=lambda t: -scores[h, t])[:n_imp]
        cands = [t for t in range(T) if t not in imp]
        cands.sort(key=lambda t: (sum(bits[b][t] != anchor[b] for b in range(H)), t))
        reps = [cands[j * len(cands) // n_rep] for j in range(n_rep)]
        out.append(sorted(imp + reps))
    return out


@pytest.mark.parametrize("anchor", ["zeros", "ones"])
def test_kvcrush_selection_matches_a_plain_reference(anchor):
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 24, generator=g)
    m = build_method("kvcrush", 12, r=0.5, recent_ratio=0.0, anchor=anchor)
    keep = m.crush(scores, torch.full((3,), 24), layer=0)
    bits = [0, 0, 0] if anchor == "zeros" else [1, 1, 1]
    assert keep.tolist() == _crush_reference(scores, 12, 0.5, bits)
    assert top_half_bits(scores, torch.full((3,), 24)).sum(-1).tolist() == [12, 12, 12]


def test_kvcrush_end_to_end_keeps_important_plus_representatives():
    cache = make_cache(H=2, bs=4)
    m = build_method("kvcrush", 8, r=0.5, recent_ratio=0.0, anchor="zeros")
    slot = cache.add_sequence()
    k, v = coded(range(16))
    ks = torch.stack([torch.arange(16.0), torch.arange(16.0).flip(0)])[None]  # head 0 likes late, head 1 early
    step(m, cache, slot, k, v, 0, "prefill", key_scores=ks)
    want = _crush_reference(ks[0], 8, 0.5, [0, 0])
    assert [positions(cache, slot, h) for h in range(2)] == want
    assert set(range(12, 16)) <= set(positions(cache, slot, 0)) and set(range(4)) <= set(positions(cache, slot, 1))
    assert m.describe()["representatives"] == 4
