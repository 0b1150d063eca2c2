"""QuantizedPagedKVCache against the full-precision PagedKVCache: logits, token bookkeeping, bytes, freeing,
composition with eviction, pre-RoPE keys and the Triton dequantization path."""
from __future__ import annotations

import pytest
import torch

from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec, KVQuantCodec
from kvbench.runtime.cache.block_pool import OutOfBlocksError
from kvbench.runtime.cache.caches import build_cache, codec_block_size
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.cache.kv_geometry import block_bytes
from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from tests.tiny_models import SHARP_LOGITS, tiny_model

L, H, D = 2, 2, 16


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab=256, max_positions=2048, **SHARP_LOGITS)


def _ids(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _quant(codec, num_blocks=256, block_size=16, num_layers=L, num_kv_heads=H, head_dim=D, device="cpu"):
    """A codec's cache holding at most the bytes of num_blocks full-precision fp32 blocks."""
    mem = num_blocks * block_bytes(codec_block_size(codec, block_size), head_dim, torch.float32)
    return build_cache(codec=codec, kv_memory_bytes=mem, num_layers=num_layers, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, block_size=block_size, dtype=torch.float32, device=device, max_seqs=4)


def _caches(codec, num_blocks=256, block_size=16):
    kw = dict(num_layers=L, num_kv_heads=H, head_dim=D, num_blocks=num_blocks, max_seqs=4)
    bs = codec_block_size(codec, block_size)
    return PagedKVCache(block_size=bs, **kw), _quant(codec, num_blocks, block_size)


def _feed(caches, slots, lengths, gen, start):
    """Append `lengths[i]` tokens of random K/V to slots[i] of every cache (same data), all layers."""
    Q = max(lengths)
    for s, n in zip(slots, lengths):
        if n == 0:
            continue
        pos = torch.arange(start[s], start[s] + n).unsqueeze(0)
        k = torch.randn(L, 1, H, n, D, generator=gen) * 2 + torch.linspace(-3, 3, D)
        v = torch.randn(L, 1, H, n, D, generator=gen)
        for c in caches:
            dev = c.device
            plan = c.prepare_append([s], pos.to(dev))
            for layer in range(L):
                c.write(layer, plan, k[layer].to(dev), v[layer].to(dev))
        start[s] += n
    return Q


def _packed_cols(cache, slot, layer, head):
    n = int(cache.lengths[slot, layer, head])
    nb = -(-n // cache.block_size)
    return [c for c in range(nb) if int(cache.tables[slot, layer, head, c]) >= cache.num_fp_blocks]


def _expected_bytes(cache):
    """Bytes from the tables: every live entry is a full-precision or a packed block of known size."""
    fp = pk = 0
    for s in cache.live:
        for layer in range(L):
            for h in range(H):
                n = int(cache.lengths[s, layer, h])
                ids = cache.tables[s, layer, h, : -(-n // cache.block_size)]
                pk += int((ids >= cache.num_fp_blocks).sum())
                fp += int((ids < cache.num_fp_blocks).sum())
    bs = cache.block_size
    fp_bytes = 2 * bs * D * cache.k_pool.element_size()
    c = cache.codec
    return fp * fp_bytes + pk * (c.packed_block_bytes(bs, D, "key") + c.packed_block_bytes(bs, D, "value")), fp, pk


# ---------------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("codec,tol", [(Int8Codec(), 0.05), (Fp8Codec(), 0.15), (KiviCodec(8, residual=32), 0.03)])
def test_8bit_codecs_give_logits_close_to_full(tiny, codec, tol):
    ids = _ids(200)
    full = Scorer(Engine(tiny, num_blocks=256)).score(ids, chunk_size=64)
    eng = Engine(tiny, num_blocks=256, codec=codec)
    assert isinstance(eng.cache, QuantizedPagedKVCache)
    lp = Scorer(eng).score(ids, chunk_size=64)
    err = (lp - full).abs()
    assert err.max() < tol
    assert err.max() > 0  # the old tokens really were read from packed blocks


def test_fewer_bits_cost_more_accuracy(tiny):
    ids = _ids(200, seed=1)
    full = Scorer(Engine(tiny, num_blocks=256)).score(ids, chunk_size=32)
    errs = {b: (Scorer(Engine(tiny, num_blocks=256, codec=KiviCodec(b, group_size=16, residual=32)))
                .score(ids, chunk_size=32) - full).abs().mean().item() for b in (2, 4, 8)}
    assert errs[8] < errs[4] < errs[2]


def test_pre_rope_keys_for_kvquant(tiny):
    """KVQuant stores keys before RoPE (checked against the calibration forward's pre-RoPE keys); the model
    rotates them after dequantization (the logprobs stay close to full precision)."""
    from kvbench.quant.calibration import forward_capture

    ids = _ids(200, seed=2)
    full = Scorer(Engine(tiny, num_blocks=256)).score(ids, chunk_size=32)
    codec = KVQuantCodec(4, levels="uniform", outlier_fraction=0.01)
    eng = Engine(tiny, num_blocks=256, codec=codec)
    assert eng.cache.store_pre_rope and eng.cache.block_size == 32
    lp = Scorer(eng).score(ids, chunk_size=32)
    assert (lp - full).abs().mean() < 0.06
    slot = eng.cache.add_sequence()
    for _ in Scorer(eng).prefill_chunks(slot, ids, 64):
        pass
    eng.cache.pack_pending()
    _, keys, values, _, _ = forward_capture(tiny, torch.tensor(ids))
    k, v, _ = eng.cache.gather(0, slot)  # layer 0: its K/V depend on the tokens only
    torch.testing.assert_close(k[:, :32], keys[0][:, :32].half().float())  # first block: fp16
    torch.testing.assert_close(k[:, 192:], keys[0][:, 192:].half().float())  # partial last block
    torch.testing.assert_close(v[:, :32], values[0][:, :32].half().float())
    err = (k[:, 32:192] - keys[0][:, 32:192]).abs().max()
    assert 0 < err < 0.2 * keys[0].abs().max()


# ---------------------------------------------------------------------------------------------------- bookkeeping
def test_token_bookkeeping_matches_full_cache():
    codec = KiviCodec(2, group_size=16, residual=32)
    full, quant = _caches(codec)
    gen = torch.Generator().manual_seed(0)
    a, b = full.add_sequence(), full.add_sequence()
    assert (quant.add_sequence(), quant.add_sequence()) == (a, b)
    start = {a: 0, b: 0}
    for step in [(40, 70), (100, 3)] + [(1, 1)] * 20:  # chunked prefill, then decoding
        _feed([full, quant], [a, b], list(step), gen, start)
        for s in (a, b):
            assert torch.equal(full.lengths[s], quant.lengths[s])
            n = min(full.positions.shape[-1], quant.positions.shape[-1])
            assert torch.equal(full.positions[s, ..., :n], quant.positions[s, ..., :n])
    quant.pack_pending()
    bs = quant.block_size
    for s in (a, b):
        for layer in range(L):
            kf, vf, pf = full.gather(layer, s)
            kq, vq, pq = quant.gather(layer, s)
            assert torch.equal(pf, pq)
            for h in range(H):
                n = int(quant.lengths[s, layer, h])
                packed = _packed_cols(quant, s, layer, h)
                assert packed == list(codec.packed_block_range(n, bs))  # exactly the blocks the rule packs
                is_packed = torch.zeros(n, dtype=torch.bool)
                for c in packed:
                    is_packed[c * bs:(c + 1) * bs] = True
                # full-precision window: fp16 of the written values; packed: within the 2-bit error bound
                torch.testing.assert_close(kq[h, ~is_packed], kf[h, ~is_packed].half().float())
                torch.testing.assert_close(vq[h, ~is_packed], vf[h, ~is_packed].half().float())
                k_err = (kq[h, is_packed] - kf[h, is_packed]).abs()
                span = kf[h].max() - kf[h].min()
                assert 0 < k_err.max() <= span / 3 / 2 * 1.01
                assert (vq[h, is_packed] - vf[h, is_packed]).abs().max() > 0


def test_new_tokens_attend_to_packed_and_window(tiny):
    """attend() equals a dense reference over the dequantized cache (gather) for a decode step."""
    codec = KiviCodec(4, group_size=16, residual=32)
    _, quant = _caches(codec)
    gen = torch.Generator().manual_seed(1)
    s = quant.add_sequence()
    start = {s: 0}
    _feed([quant], [s], [150], gen, start)
    plan = quant.prepare_append([s], torch.tensor([[150]]))  # packs, then room for one token
    kn, vn = torch.randn(1, H, 1, D, generator=gen), torch.randn(1, H, 1, D, generator=gen)
    q = torch.randn(1, 2 * H, 1, D, generator=gen)
    from kvbench.runtime.backends.torch.backend import TORCH

    for layer in range(L):
        quant.write(layer, plan, kn, vn)
        out, scores = quant.attend(layer, q, plan, 0.25, backend=TORCH, return_key_scores=True, causal=False)
        k, v, _ = quant.gather(layer, s)  # [H, T, D]
        ref_p = torch.softmax(torch.einsum("hgd,htd->hgt", q[0].view(H, 2, D), k) * 0.25, -1)
        ref = torch.einsum("hgt,htd->hgd", ref_p, v).reshape(2 * H, D)
        torch.testing.assert_close(out[0, :, 0], ref, atol=1e-5, rtol=1e-5)
        T = k.shape[1]  # decode scores cover the tables' whole width: zero past the length
        torch.testing.assert_close(scores[0, :, :T], ref_p.sum(1), atol=1e-5, rtol=1e-5)
        assert (scores[0, :, T:] == 0).all()
    assert quant.block_counts()["packed"] > 0


# ---------------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("codec", [KiviCodec(2, group_size=16, residual=32), Int8Codec(),
                                   KVQuantCodec(3, levels="uniform")])
def test_bytes_counted_are_pool_bytes_and_blocks_freed_at_once(codec):
    _, quant = _caches(codec)
    gen = torch.Generator().manual_seed(2)
    a, b = quant.add_sequence(), quant.add_sequence()
    start = {a: 0, b: 0}
    peak_seen = 0
    for step in [(64, 96), (64, 0)] + [(1, 1)] * 40:
        _feed([quant], [a, b], list(step), gen, start)
        expected, n_fp, n_pk = _expected_bytes(quant)
        assert quant.kv_bytes_in_use() == expected
        # no full-precision block outlives its packing: the pools hold exactly what the tables reference
        assert quant.pool.fp.in_use == n_fp and quant.pool.packed.in_use == n_pk
        peak_seen = max(peak_seen, expected)
        quant.pool.check_consistency()
    assert n_pk > 0
    assert quant.peak_kv_bytes() == peak_seen
    assert quant.kq_pool.shape[1] == codec.packed_block_bytes(quant.block_size, D, "key")
    bits = quant.bits_per_element_in_use()
    assert bits == 8 * expected / quant.held_elements()
    quant.free_sequence(a)
    assert quant.kv_bytes_in_use() == _expected_bytes(quant)[0] > 0
    quant.free_sequence(b)
    assert quant.kv_bytes_in_use() == 0 and quant.pool.in_use == 0
    quant.pool.check_consistency()


def test_kivi2_bits_at_long_context():
    """At 4096 tokens (head_dim 64, G=32, R=128, fp16 window) KIVI-2 costs 3.41 bits per element."""
    codec = KiviCodec(2)
    quant = _quant(codec, 400, 16, num_layers=1, num_kv_heads=1, head_dim=64)
    s = quant.add_sequence()
    plan = quant.prepare_append([s], torch.arange(4096).unsqueeze(0))
    quant.write(0, plan, torch.randn(1, 1, 4096, 64), torch.randn(1, 1, 4096, 64))
    quant.pack_pending()
    bits = quant.bits_per_element_in_use()
    assert bits == pytest.approx((124 * 32 * 3 + 128 * 16) / 4096)
    assert bits <= 3.5


def test_pool_bytes_bound_every_allocation():
    """kv_memory_bytes bounds full-precision and packed blocks together: an append past it raises and changes
    nothing; packing (which frees more than it takes) always succeeds, and then the append fits."""
    codec = KiviCodec(2, group_size=16, residual=16)
    quant = _quant(codec, 8, 16, num_layers=1, num_kv_heads=1)  # the bytes of 8 fp32 blocks = 16 fp16 blocks
    s = quant.add_sequence()
    plan = quant.prepare_append([s], torch.arange(240).unsqueeze(0))  # 15 fp16 blocks
    quant.write(0, plan, torch.randn(1, 1, 240, D), torch.randn(1, 1, 240, D))
    tables, in_use = quant.tables.clone(), quant.pool.in_use
    with pytest.raises(OutOfBlocksError):
        PagedKVCache.prepare_append(quant, [s], torch.arange(240, 272).unsqueeze(0))  # 2 more: over the bytes
    assert torch.equal(quant.tables, tables) and quant.pool.in_use == in_use
    quant.pool.check_consistency()
    assert quant.free_blocks() == 1
    plan = quant.prepare_append([s], torch.arange(240, 272).unsqueeze(0))  # packs first, then fits
    assert quant.kv_bytes_in_use() <= quant.pool_bytes()
    assert quant.free_blocks() > 1


# ---------------------------------------------------------------------------------------------------- eviction
def _filled(codec, n=200, seed=3):
    _, quant = _caches(codec)
    s = quant.add_sequence()
    _feed([quant], [s], [n], torch.Generator().manual_seed(seed), {s: 0})
    quant.pack_pending()
    return quant, s


def test_evict_blocks_drops_packed_and_fp_blocks_at_once():
    codec = KiviCodec(2, group_size=16, residual=64)
    quant, s = _filled(codec)
    bs = quant.block_size  # 16
    before = [quant.gather(layer, s) for layer in range(L)]
    packed = _packed_cols(quant, s, 0, 1)
    fp_full = [c for c in range(200 // bs) if c not in packed]
    drop = [packed[1], fp_full[0]]
    in_use, nbytes = quant.pool.in_use, quant.kv_bytes_in_use()
    quant.evict_blocks(0, s, 1, drop)
    assert quant.pool.in_use == in_use - 2
    assert quant.kv_bytes_in_use() == nbytes - quant.packed_block_bytes - quant.bytes_per_block
    assert quant.kv_bytes_in_use() == _expected_bytes(quant)[0]
    k, v, pos = quant.gather(0, s)
    keep = torch.tensor([t for t in range(200) if t // bs not in drop])
    assert int(quant.lengths[s, 0, 1]) == 200 - 2 * bs
    assert torch.equal(k[1, : keep.numel()], before[0][0][1, keep])  # nothing moved, nothing re-encoded
    assert torch.equal(v[1, : keep.numel()], before[0][1][1, keep])
    assert torch.equal(pos[1, : keep.numel()], keep.to(pos.dtype))
    assert torch.equal(k[0], before[0][0][0])  # other head untouched
    # decoding continues: the next step packs by the rule again and new tokens land in full-precision blocks
    gen = torch.Generator().manual_seed(9)
    _feed([quant], [s], [1], gen, {s: 200})
    assert int(quant.lengths[s, 0, 1]) == 200 - 2 * bs + 1
    quant.pool.check_consistency()


def test_keep_tokens_reuses_aligned_blocks_and_requantizes_the_rest():
    codec = KiviCodec(4, group_size=16, residual=64)
    quant, s = _filled(codec)
    bs = quant.block_size
    k0, v0, p0 = quant.gather(1, s)
    packed_before = quant.block_counts()["packed"]
    # head 0: drop block 2 exactly (aligned: every other block kept as is); head 1: drop scattered tokens
    keep0 = torch.tensor([t for t in range(200) if t // bs != 2])
    keep1 = torch.tensor([t for t in range(200) if t % 7 != 3 or t < 40])
    keep = torch.full((H, 200), -1)
    keep[0, : keep0.numel()] = keep0
    keep[1, : keep1.numel()] = keep1
    quant.keep_tokens(1, s, keep)
    k, v, p = quant.gather(1, s)
    assert quant.lengths[s, 1].tolist() == [keep0.numel(), keep1.numel()]
    assert torch.equal(p[0, : keep0.numel()], p0[0, keep0]) and torch.equal(p[1, : keep1.numel()], p0[1, keep1])
    assert torch.equal(k[0, : keep0.numel()], k0[0, keep0])  # aligned: exact, no second rounding
    assert torch.equal(v[0, : keep0.numel()], v0[0, keep0])
    # head 1: the untouched prefix (tokens < 40 -> blocks 0, 1) is exact; the rest within 4-bit error
    assert torch.equal(k[1, :32], k0[1, :32])
    err = (k[1, : keep1.numel()] - k0[1, keep1]).abs().max()
    assert err < 0.5 * (k0[1].max() - k0[1].min()) / 15 * 2
    assert quant.kv_bytes_in_use() == _expected_bytes(quant)[0]
    assert packed_before - quant.block_counts()["packed"] >= 1  # block 2 of head 0 went back at once
    for h in range(H):  # the rule holds again after the keep
        n = int(quant.lengths[s, 1, h])
        assert set(codec.packed_block_range(n, bs)) <= set(_packed_cols(quant, s, 1, h))
    quant.pool.check_consistency()
    quant.free_sequence(s)
    assert quant.pool.in_use == 0


def test_fork_shares_packed_blocks():
    codec = KiviCodec(2, group_size=16, residual=32)
    quant, s = _filled(codec, n=100)
    k0 = quant.gather(0, s)[0].clone()
    in_use = quant.pool.in_use
    child = quant.fork(s)
    assert quant.pool.in_use == in_use  # shared, not copied
    assert _packed_cols(quant, child, 0, 0) == _packed_cols(quant, s, 0, 0) != []
    _feed([quant], [child], [40], torch.Generator().manual_seed(5), {child: 100})
    assert torch.equal(quant.gather(0, s)[0], k0)  # the parent's tokens are unchanged
    assert torch.equal(quant.gather(0, child)[0][:, :100], k0)
    quant.free_sequence(s)
    quant.free_sequence(child)
    assert quant.pool.in_use == 0
    quant.pool.check_consistency()


class _DropSecondBlock:
    """A tiny block-eviction policy: when a table exceeds `budget` tokens, drop its second block."""

    needs_key_scores = False
    store_pre_rope = False
    rope_mode = "original"
    budget = 64

    def make_codec(self, model):
        return None

    def attach(self, cache, cfg):
        self.cache = cache
        self.max_len = 0

    def after_attention(self, ctx):
        c = ctx.cache
        for s in ctx.plan.slots.tolist():
            for h in range(c.num_kv_heads):
                n = int(c.lengths[s, ctx.layer, h])
                if n > self.budget and n % c.block_size == 0:
                    c.evict_blocks(ctx.layer, s, h, [1])
            self.max_len = max(self.max_len, int(c.lengths[s, ctx.layer].max()))

    def on_sequence_end(self, slot):
        pass


def test_eviction_method_composes_with_codec(tiny):
    prompt = _ids(48, seed=4)
    plain = _DropSecondBlock()
    e_plain = Engine(tiny, plain, num_blocks=256)
    g_plain = e_plain.generate([prompt], max_new_tokens=60)[0]
    method = _DropSecondBlock()
    eng = Engine(tiny, method, num_blocks=256, codec=KiviCodec(2, group_size=16, residual=16))
    assert isinstance(eng.cache, QuantizedPagedKVCache)
    g = eng.generate([prompt], max_new_tokens=60)[0]
    assert len(g.token_ids) == 60
    assert method.max_len <= method.budget + eng.cache.block_size  # eviction really ran on the quantized cache
    stats = eng.memory_stats()
    assert stats["peak_kv_bytes"] < e_plain.memory_stats()["peak_kv_bytes"] / 2
    assert stats["full_kv_bytes"] == pytest.approx(e_plain.memory_stats()["full_kv_bytes"], rel=0.1)
    assert eng.cache.pool.in_use == 0 and len(g_plain.token_ids) == 60


# ---------------------------------------------------------------------------------------------------- triton
@pytest.fixture(scope="module")
def triton_dequant():
    """kvbench.runtime.backends.triton.dequant imported with TRITON_INTERPRET=1 on a machine without a GPU."""
    pytest.importorskip("triton")
    import importlib
    import os
    import sys

    name = "kvbench.runtime.backends.triton.dequant"
    if name not in sys.modules:
        old = os.environ.get("TRITON_INTERPRET")
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        try:
            importlib.import_module(name)
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
    return sys.modules[name]


def test_triton_dequant_path_matches_torch(triton_dequant):
    codec = KiviCodec(2, group_size=16, residual=32)
    # the compiled kernel (a GPU machine) reads GPU tensors; on a CPU the interpreter reads CPU ones
    quant = _quant(codec, device="cuda" if torch.cuda.is_available() else "cpu")
    s = quant.add_sequence()
    _feed([quant], [s], [120], torch.Generator().manual_seed(3), {s: 0})
    quant.pack_pending()
    quant.dequant = "torch"
    ref = quant.gather(1, s)
    quant.dequant = "triton"
    k, v, _ = quant.gather(1, s)
    torch.testing.assert_close(k, ref[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v, ref[1], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        QuantizedPagedKVCache(codec=Int8Codec(), num_layers=1, num_kv_heads=1, head_dim=D, block_size=16,
                              max_bytes=2**16, dequant="triton")


def test_storage_is_described():
    _, quant = _caches(KiviCodec(4, group_size=32, residual=64))
    d = quant.describe_storage()
    assert d["codec"] == "kivi" and d["codec_bits"] == 4 and d["block_size"] == 32
    assert d["fp_block_dtype"] == "float16"
    assert d["packed_bits_per_element"] == pytest.approx(8 * quant.packed_block_bytes / (2 * 32 * D))
    assert quant.full_bytes_per_token == 2 * L * H * D * 4
