"""The C codec prefill kernel (codec_prefill_attention in csrc/codec_decode.c: a causal chunk of queries read block
by block from the packed and full-precision pools, no dense copy) equals dequantize-then-attend (the torch
reference over QuantizedPagedKVCache's dense blocks): KIVI-2/4 (keys per channel and per token), KIVI-8 and int8,
fp32 queries, ragged batches, heads of different lengths after eviction, GQA groups 1-8.
Tolerance: atol 2e-5, rtol 1e-5 on the outputs (fp32; only the order of the sums differs)."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvbench.quant.codecs import Fp8Codec, KiviCodec
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu.backend import CPU
from kvbench.runtime.backends.torch.attention import paged_attention_torch
from kvbench.runtime.backends.torch.backend import TORCH
from tests.runtime.test_codec_decode_kernel import CODECS, L, filled
from tests.tiny_models import HEAD_DIM_64, tiny_model

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


class _Plan:  # what `attend` reads of an AppendPlan
    def __init__(self, cache, idx, qpos):
        self.tables, self.lengths, self.slots, self.query_positions = cache.tables[idx], cache.lengths[idx], idx, qpos
        self.positions = cache.positions[idx]


def _chunk_both(cache, slots, layer, group, Q, seed=1):
    """(reference, kernel) outputs of a causal chunk: the last Q positions of each sequence as queries."""
    H, D = cache.num_kv_heads, cache.head_dim
    q = torch.randn(len(slots), H * group, Q, D, generator=torch.Generator().manual_seed(seed))
    idx = torch.tensor(slots)
    top = cache.positions[idx, layer].amax(dim=(1, 2))  # [S] newest position
    qpos = top[:, None].to(torch.int64) - Q + 1 + torch.arange(Q)  # [S, Q]
    plan = _Plan(cache, idx, qpos)
    assert CPU.packed_kernel(cache, q, causal=True) == "prefill"
    ref, _ = cache.attend(layer, q, plan, 0.125, backend=TORCH, causal=True)
    via_attend, ks = cache.attend(layer, q, plan, 0.125, backend=CPU, causal=True)
    fast = cpu_kernels.codec_prefill_attention_cpu(
        q, cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool, CPU.block_formats(cache), plan.tables[:, layer],
        plan.lengths[:, layer], cache.positions[idx, layer], qpos, 0.125)
    torch.testing.assert_close(via_attend, fast, atol=0, rtol=0)  # attend takes the kernel path
    assert ks is None
    return ref, fast


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("lengths,group,Q", [([40], 1, 40), ([300], 3, 53), ([5, 513, 256, 1000], 2, 5),
                                             ([97, 64], 8, 33)])
def test_prefill_kernel_matches_dequantize_then_attend(name, lengths, group, Q):
    cache, slots = filled(CODECS[name](), lengths)
    packed = sum(int((cache.tables[s] >= cache.num_fp_blocks).sum()) for s in slots)
    assert packed > 0 or max(lengths) < 128  # the long tables hold packed blocks: both pools are read
    for layer in range(L):
        ref, out = _chunk_both(cache, slots, layer, group, Q)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_kernel_over_heads_of_different_lengths(head_dim):
    cache, slots = filled(KiviCodec(2, group_size=32, residual=64), [700, 450], D=head_dim)
    cache.evict_blocks(0, slots[0], 1, [1, 4, 9])  # packed blocks of one head only
    keep = torch.tensor([[t for t in range(450) if t % 3] + [-1] * 150, list(range(450))])
    cache.keep_tokens(1, slots[1], keep)  # token-level: head 0 compacted and partly re-encoded
    for layer in range(L):
        ref, out = _chunk_both(cache, slots, layer, 3, 40)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_prefill_kernel_fails_when_the_mask_is_wrong():
    """The comparison can fail: the same kernel over positions shifted by one (each query sees one key more)."""
    cache, slots = filled(KiviCodec(4, group_size=32, residual=32), [200])
    ref, _ = _chunk_both(cache, slots, 0, 2, 16)
    idx = torch.tensor(slots)
    q = torch.randn(1, 4, 16, 64, generator=torch.Generator().manual_seed(1))
    qpos = 199 - 15 + torch.arange(16)[None] + 1  # one position later
    wrong = cpu_kernels.codec_prefill_attention_cpu(
        q, cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool, CPU.block_formats(cache), cache.tables[idx, 0],
        cache.lengths[idx, 0], cache.positions[idx, 0], qpos, 0.125)
    assert not torch.allclose(wrong, ref, atol=2e-5, rtol=1e-5)


def test_unreadable_codecs_and_key_scores_keep_the_dequantizing_path():
    cache, _ = filled(Fp8Codec(), [100])
    assert CPU.packed_kernel(cache, torch.zeros(1, 4, 8, 64), causal=True) is None
    kivi, _ = filled(KiviCodec(2, group_size=32, residual=64), [100])
    assert CPU.packed_kernel(kivi, torch.zeros(1, 4, 8, 64), rotate_keys=lambda k, p: k,
                             causal=True) is None  # pre-RoPE keys
    assert CPU.packed_kernel(kivi, torch.zeros(1, 4, 8, 64), causal=True,
                             return_key_scores=True) is None  # per-key mass
    assert CPU.packed_kernel(kivi, torch.zeros(1, 4, 1, 64), causal=True) is None  # one query: not a chunk


@pytest.mark.parametrize("codec", ["kivi2", None])
def test_engine_prefill_logits_with_and_without_the_kernel(codec):
    """A whole model: prompt logits through the prefill kernel (over a KIVI-2 cache, or the full-precision pool)
    equal the torch path's (dequantize-then-attend / gather-then-attend)."""
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    model = tiny_model(vocab=300, **HEAD_DIM_64)
    ids = torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = {}
    for backend in ("cpu", "torch"):
        engine = Engine(model, attention_backend=backend, kv_memory_bytes=2**24, prefill_chunk_size=96,
                        codec=KiviCodec(2, group_size=32, residual=32) if codec else None)
        runs[backend] = Scorer(engine).score(ids)  # chunks after the first attend over packed blocks
    torch.testing.assert_close(runs["cpu"], runs["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group,lengths", [(1, [700]), (3, [300, 1000, 65]), (8, [129, 40])])
def test_full_precision_later_chunks_take_the_prefill_kernel(group, lengths):
    """paged_attention_cpu sends a causal chunk over keys cached before it (a later prefill chunk) to the same
    kernel over the plain fp32 pool, heads of different lengths included; results equal the torch reference."""
    from kvbench.runtime.cache.kv_cache import PagedKVCache

    H, D, Q = 2, 64, 37
    cache = PagedKVCache(num_layers=1, num_kv_heads=H, head_dim=D, block_size=16, num_blocks=600, max_seqs=4)
    gen = torch.Generator().manual_seed(0)
    slots = [cache.add_sequence() for _ in lengths]
    for s, n in zip(slots, lengths):
        plan = cache.prepare_append([s], torch.arange(n)[None])
        cache.write(0, plan, torch.randn(1, H, n, D, generator=gen) * 2, torch.randn(1, H, n, D, generator=gen))
    cache.keep_tokens(0, slots[0], torch.tensor([[t for t in range(lengths[0]) if t % 5] +
                                                 [-1] * (lengths[0] // 5 + (lengths[0] % 5 > 0)),
                                                 list(range(lengths[0]))])[:, :lengths[0]])
    idx = torch.tensor(slots)
    tables, lens, kpos = cache.tables[idx, 0], cache.lengths[idx, 0], cache.positions[idx, 0]
    qpos = torch.tensor([n - Q for n in lengths])[:, None] + torch.arange(Q)  # the last Q positions
    q = torch.randn(len(slots), H * group, Q, D, generator=gen)
    ref, _ = paged_attention_torch(q, cache.k_pool, cache.v_pool, tables, lens, kpos, qpos, 0.125, causal=True)
    out, ks = cpu_kernels.paged_attention_cpu(q, cache.k_pool, cache.v_pool, tables, lens, kpos, qpos, 0.125,
                                              causal=True)
    direct = cpu_kernels.codec_prefill_attention_cpu(q, cache.k_pool, cache.v_pool, cpu_kernels._NO_PACKED,
                                                     cpu_kernels._NO_PACKED, cpu_kernels._FP_ONLY, tables, lens, kpos,
                                                     qpos, 0.125)
    torch.testing.assert_close(out, direct, atol=0, rtol=0)  # the kernel path was taken
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    assert ks is None


@pytest.mark.parametrize("name", ["kivi2", "int8"])
def test_a_query_gets_the_same_bits_in_any_chunk(name):
    """The kernel's register tiles (several queries per loaded key vector, several query rows per loaded value row)
    leave each query's sums in the same order: a query's output is bit-identical whether it is computed in a chunk
    of 300, of 157 (other tile remainders and work items) or alone, and in a batch with another sequence."""
    cache, slots = filled(CODECS[name](), [700, 333])
    idx = torch.tensor(slots)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 300, 64, generator=gen)
    qpos = torch.tensor([400, 33])[:, None] + torch.arange(300)  # sequence 0: positions 400-699; 1: 33-332

    def run(sl, lo, hi):
        return cpu_kernels.codec_prefill_attention_cpu(
            q[sl, :, lo:hi].contiguous(), cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool,
            CPU.block_formats(cache), cache.tables[idx[sl], 0], cache.lengths[idx[sl], 0],
            cache.positions[idx[sl], 0], qpos[sl, lo:hi].contiguous(), 0.125)

    whole = run(slice(0, 2), 0, 300)
    alone = run(slice(0, 1), 0, 300)
    part = run(slice(0, 1), 143, 300)
    single = run(slice(0, 1), 211, 212)
    torch.testing.assert_close(whole[:1], alone, atol=0, rtol=0)
    torch.testing.assert_close(part, alone[:, :, 143:], atol=0, rtol=0)
    torch.testing.assert_close(single, alone[:, :, 211:212], atol=0, rtol=0)
    assert not torch.equal(whole[0, :, 211], whole[0, :, 212])  # the rows differ: the comparison can fail
