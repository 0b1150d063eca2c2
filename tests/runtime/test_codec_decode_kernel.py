"""The C codec decode kernel (csrc/codec_decode.c) equals the dequantize-then-attend path of
QuantizedPagedKVCache: KIVI 2/4/8-bit (keys per channel and per token), int8, NVFP4, MXFP4, ragged batches, heads
of different lengths after eviction, packed and full-precision blocks mixed, and the per-key attention mass."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec, KVQuantCodec
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.rotation import RotatedCodec
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu.backend import CPU
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.cache.caches import build_cache, codec_block_size
from kvbench.runtime.cache.kv_geometry import block_bytes
from tests.tiny_models import HEAD_DIM_64, tiny_model

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")

L = 2

CODECS = {
    "kivi2": lambda: KiviCodec(2, group_size=32, residual=64),
    "kivi4": lambda: KiviCodec(4, group_size=32, residual=32),
    "kivi8": lambda: KiviCodec(8, group_size=16, residual=32),
    "kivi2_token_keys": lambda: KiviCodec(2, group_size=32, residual=64, key_axis="token"),
    "int8": lambda: Int8Codec(),
    "nvfp4": lambda: Nvfp4Codec(),
    "nvfp4_fixed_amax": lambda: Nvfp4Codec(tensor_amax=12.0),  # some values saturate
    "mxfp4": lambda: Mxfp4Codec(),
}


def filled(codec, lengths, *, H=2, D=64, seed=0):
    """A codec cache with one sequence per length, fed in interleaved chunks, then packed by the codec's rule."""
    bs = codec_block_size(codec, 16)
    mem = 4000 * block_bytes(bs, D, torch.float32)
    cache = build_cache(codec=codec, kv_memory_bytes=mem, num_layers=L, num_kv_heads=H, head_dim=D, block_size=16,
                        dtype=torch.float32, device="cpu", max_seqs=8)
    gen = torch.Generator().manual_seed(seed)
    slots = [cache.add_sequence() for _ in lengths]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        for i, (s, n) in enumerate(zip(slots, lengths)):
            q = min(53, n - done[i])
            if q <= 0:
                continue
            plan = cache.prepare_append([s], torch.arange(done[i], done[i] + q).unsqueeze(0))
            for layer in range(L):
                k = torch.randn(1, H, q, D, generator=gen) * 2 + torch.linspace(-3, 3, D)
                cache.write(layer, plan, k, torch.randn(1, H, q, D, generator=gen))
            done[i] += q
    cache.pack_pending()
    return cache, slots


def both(cache, slots, layer, group, *, seed=1):
    """(reference, kernel) results of one decode query per sequence on `layer`: (out, key_scores) each."""
    H, D = cache.num_kv_heads, cache.head_dim
    q = torch.randn(len(slots), H * group, 1, D, generator=torch.Generator().manual_seed(seed))
    idx = torch.tensor(slots)
    tables, lengths = cache.tables[idx, layer], cache.lengths[idx, layer]
    qpos = lengths.max(dim=1).values.unsqueeze(1)

    class Plan:  # what `attend` reads of an AppendPlan
        pass

    plan = Plan()
    plan.tables, plan.lengths, plan.slots, plan.query_positions = cache.tables[idx], cache.lengths[idx], idx, qpos
    plan.positions = cache.positions[idx]
    assert CPU.packed_kernel(cache, q, causal=False, return_key_scores=True) == "decode"
    ref_out, ref_ks = cache.attend(layer, q, plan, 0.125, backend=TORCH, return_key_scores=True, causal=False)
    T = int(lengths.max())  # the torch decode scores cover the tables' whole width: zero past the lengths
    assert (ref_ks[:, :, T:] == 0).all()
    ref = ref_out, ref_ks[:, :, :T]
    fast = cpu_kernels.codec_decode_attention_cpu(
        q, cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool, CPU.block_formats(cache), tables, lengths,
        0.125, return_key_scores=True)
    via_attend = cache.attend(layer, q, plan, 0.125, backend=CPU, return_key_scores=True, causal=False)
    torch.testing.assert_close(via_attend[0], fast[0], atol=0, rtol=0)  # attend takes the kernel path
    return ref, fast


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("lengths,group", [([40], 1), ([300], 3), ([5, 513, 256, 1000], 2), ([97, 64], 8)])
def test_kernel_matches_dequantized_attention(name, lengths, group):
    cache, slots = filled(CODECS[name](), lengths)
    assert CPU.packed_kernel(cache, torch.zeros(1, 2 * group, 1, 64), causal=False) == "decode"
    packed = sum(int((cache.tables[s] >= cache.num_fp_blocks).sum()) for s in slots)
    assert packed > 0 or max(lengths) < 128  # the long tables hold packed blocks: both pools are read
    for layer in range(L):
        (ref, ref_ks), (out, ks) = both(cache, slots, layer, group)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ks, ref_ks, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_heads_of_different_lengths_after_eviction(head_dim):
    cache, slots = filled(KiviCodec(2, group_size=32, residual=64), [700, 450], D=head_dim)
    bs = cache.block_size
    cache.evict_blocks(0, slots[0], 1, [1, 4, 9])  # packed blocks of one head only
    keep = torch.tensor([[t for t in range(450) if t % 3] + [-1] * 150, list(range(450))])
    cache.keep_tokens(1, slots[1], keep)  # token-level: head 0 compacted and partly re-encoded
    assert int(cache.lengths[slots[0], 0, 1]) == 700 - 3 * bs
    for layer in range(L):
        (ref, ref_ks), (out, ks) = both(cache, slots, layer, 3)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ks, ref_ks, atol=2e-6, rtol=1e-5)


def test_unreadable_codecs_use_the_dequantizing_path():
    cache, _ = filled(Fp8Codec(), [100])
    assert CPU.packed_kernel(cache, torch.zeros(1, 4, 1, 64), causal=False) is None
    kvq = KVQuantCodec(bits=3, levels="uniform")
    assert cpu_kernels.codec_block_format(kvq, "key", 32, 64) is None
    rotated, _ = filled(RotatedCodec(Mxfp4Codec()), [100])  # rows of rotated K / V: the query is not rotated here
    assert CPU.packed_kernel(rotated, torch.zeros(1, 4, 1, 64), causal=False) is None
    kivi, _ = filled(KiviCodec(2, group_size=32, residual=64), [100])
    assert CPU.packed_kernel(kivi, torch.zeros(1, 4, 2, 64), causal=True) != "decode"  # a prefill chunk
    assert CPU.packed_kernel(kivi, torch.zeros(1, 4, 1, 64), rotate_keys=lambda k, p: k,
                             causal=False) is None  # keys rotated at read time


@pytest.mark.parametrize("codec", [lambda: KiviCodec(2, group_size=32, residual=32), Nvfp4Codec, Mxfp4Codec],
                         ids=["kivi2", "nvfp4", "mxfp4"])
def test_engine_decodes_the_same_tokens_with_and_without_the_kernel(codec):
    from kvbench.runtime.serving.engine import Engine

    model = tiny_model(vocab=300, **HEAD_DIM_64)
    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (150, 90)]
    runs = {}
    for backend in ("cpu", "torch"):
        engine = Engine(model, attention_backend=backend, codec=codec(), kv_memory_bytes=2**24)
        runs[backend] = [g.token_ids for g in engine.generate(prompts, max_new_tokens=40)]
    assert runs["cpu"] == runs["torch"]
