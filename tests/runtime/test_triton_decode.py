"""The split-KV Triton decode kernel (backends/triton/decode.py) against an fp64 torch reference, outputs and per-key
attention mass, under the Triton interpreter (fp32 / fp16; KVBENCH_TEST_GPU=1 on a CUDA machine: compiled, bf16 too).
The caches are poisoned as in test_triton_attention.py (NaN wherever the kernel must not read). The codec variant
reads KIVI-2, KIVI-4 and int8 packed rows in place and must equal dequantize-then-attend."""

from tests.runtime.test_triton_attention import (DEVICE, GPU_ONLY, ON_GPU, SCORE_TOL, TOL, make_case,  # noqa: I001
                                         reference_paged_attention)

import pytest  # noqa: E402
import torch  # noqa: E402

from kvbench.quant.codecs import Int8Codec, KiviCodec  # noqa: E402
from kvbench.runtime.backends.triton import decode as td  # noqa: E402
from kvbench.runtime.backends.triton.attention import _interpreting  # noqa: E402

if not ON_GPU and not _interpreting():  # pragma: no cover
    pytest.skip("the Triton modules were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


def decode_case(lengths, *, group, head_dim, block_size, dtype, seed):
    """A poisoned decode case (one query per sequence, at the newest position: every cached key visible)."""
    seq_lens = [max(max(row), 1) for row in lengths]
    return make_case(lengths, 1, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed,
                     seq_lens=seq_lens)


def check(case, num_splits, **kw):
    q, k_pool, v_pool, tables, lengths, key_positions, query_positions = case
    scale = q.shape[-1] ** -0.5
    out, ks = td.paged_decode_triton(q, k_pool, v_pool, tables, lengths, scale, return_key_scores=True,
                                     num_splits=num_splits, **kw)
    ref_out, ref_ks = reference_paged_attention(*case, scale)
    assert torch.isfinite(out).all() and torch.isfinite(ks).all(), "read a poisoned slot"
    torch.testing.assert_close(out, ref_out, **TOL[q.dtype])
    torch.testing.assert_close(ks, ref_ks, **SCORE_TOL[q.dtype])
    group = q.shape[1] // lengths.shape[1]
    for b in range(lengths.shape[0]):  # each row hands out probability 1 (empty tables: none)
        for h in range(lengths.shape[1]):
            expect = group if int(lengths[b, h]) else 0
            assert float(ks[b, h].sum()) == pytest.approx(expect, rel=1e-3, abs=1e-3)
    out_only, none = td.paged_decode_triton(q, k_pool, v_pool, tables, lengths, scale, num_splits=num_splits, **kw)
    assert none is None
    torch.testing.assert_close(out_only, out, atol=0, rtol=0)
    return out


# lengths: ragged across the batch and the heads, one empty table, one table a multiple of the block size
RAGGED = [[37, 0, 16, 70], [1, 33, 64, 5]]


# split counts 1, several, and 6 > the 5 blocks of the longest table (empty splits merge to nothing); GQA 1 / 4 / 8
@pytest.mark.parametrize("num_splits,group", [(1, 4), (3, 1), (3, 8), (6, 4)])
def test_splits_and_gqa(num_splits, group):
    case = decode_case(RAGGED, group=group, head_dim=32, block_size=16, dtype=torch.float32, seed=group)
    check(case, num_splits)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=GPU_ONLY)])
def test_block_sizes_and_dtypes(block_size, dtype):
    case = decode_case([[45, 0], [9, 32]], group=4, head_dim=48, block_size=block_size, dtype=dtype,
                       seed=block_size)
    check(case, 2, block_n=16)


def test_all_tables_empty_gives_zeros():
    case = decode_case([[0, 0]], group=2, head_dim=16, block_size=8, dtype=torch.float32, seed=3)
    out = check(case, 4)
    assert (out == 0).all()


def test_split_count_follows_the_device_and_capacity():
    assert td.default_num_splits(torch.device("cpu"), 1, 8, 32768) == 4  # a fixed value off CUDA
    if ON_GPU:
        long = td.default_num_splits(torch.device(DEVICE), 1, 8, 32768)
        short = td.default_num_splits(torch.device(DEVICE), 1, 8, 64)
        busy = td.default_num_splits(torch.device(DEVICE), 256, 8, 32768)
        assert long > short == 1 and busy == 1 and long <= td.MAX_SPLITS


# ---------------------------------------------------------------------------------------------------------- codecs
def codec_case(codec, *, block_size, head_dim, group, dtype, seed=0):
    """Two pools as QuantizedPagedKVCache keeps them (fp16 full-precision blocks below num_fp, packed rows above),
    a table mixing both (packed first, the newest blocks full precision), and the dequantized dense pool that
    dequantize-then-attend reads."""
    g = torch.Generator().manual_seed(seed)
    lengths = [[3 * block_size + 5, 0], [2 * block_size, block_size + 1]]
    B, H = len(lengths), len(lengths[0])
    n_blocks = sum(-(-n // block_size) for row in lengths for n in row)
    num_fp = n_blocks + 2
    dense_k = torch.randn(n_blocks, block_size, head_dim, generator=g) * 2 + 0.5
    dense_v = torch.randn(n_blocks, block_size, head_dim, generator=g)
    k_fp = torch.full((num_fp, block_size, head_dim), float("nan"), dtype=torch.float16)
    v_fp = k_fp.clone()
    k_rows = codec.encode_keys(dense_k)
    v_rows = codec.encode_values(dense_v)
    kq = torch.zeros(n_blocks + 1, k_rows.shape[1], dtype=torch.uint8)
    vq = torch.zeros(n_blocks + 1, v_rows.shape[1], dtype=torch.uint8)
    tables = torch.full((B, H, 5), num_fp - 1, dtype=torch.int32)  # unused entries: a NaN block
    ref_k = torch.full((n_blocks + 1, block_size, head_dim), float("nan"))
    ref_v = ref_k.clone()
    i = 0
    for b in range(B):
        for h in range(H):
            nb = -(-lengths[b][h] // block_size)
            for c in range(nb):
                packed = c < nb - 1  # the newest block of each table stays full precision
                if packed:
                    kq[i + 1], vq[i + 1] = k_rows[i], v_rows[i]
                    tables[b, h, c] = num_fp + i + 1
                    ref_k[i] = codec.decode_keys(k_rows[i:i + 1], block_size, head_dim)[0]
                    ref_v[i] = codec.decode_values(v_rows[i:i + 1], block_size, head_dim)[0]
                else:
                    k_fp[i + 1] = dense_k[i].half()
                    v_fp[i + 1] = dense_v[i].half()
                    tables[b, h, c] = i + 1
                    ref_k[i], ref_v[i] = dense_k[i].half().float(), dense_v[i].half().float()
                i += 1
    # the dense (dequantized) view: table entry -> row of ref_k
    ref_tables = torch.zeros_like(tables)
    for b in range(B):
        for h in range(H):
            for c in range(tables.shape[2]):
                e = int(tables[b, h, c])
                ref_tables[b, h, c] = (e - num_fp - 1) if e >= num_fp else (e - 1 if e >= 1 else n_blocks)
    q = torch.randn(B, H * group, 1, head_dim, generator=g).to(dtype)
    lens = torch.tensor(lengths, dtype=torch.int64)
    to = lambda *ts: tuple(t.to(DEVICE) for t in ts)  # noqa: E731
    return to(q, k_fp, v_fp, kq, vq, tables, lens, ref_k.to(dtype), ref_v.to(dtype), ref_tables)


@pytest.mark.parametrize("codec,block_size", [
    (KiviCodec(bits=2, group_size=16, residual=16), 16),
    (KiviCodec(bits=4, group_size=32, residual=32), 32),
    (KiviCodec(bits=2, group_size=16, residual=16, key_axis="token"), 16),
    (Int8Codec(), 16),
], ids=["kivi2", "kivi4", "kivi2-token-keys", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_codec_kernel_equals_dequantize_then_attend(codec, block_size, dtype):
    q, k_fp, v_fp, kq, vq, tables, lens, ref_k, ref_v, ref_tables = codec_case(
        codec, block_size=block_size, head_dim=32, group=4, dtype=dtype, seed=block_size)
    scale = 32 ** -0.5
    out, ks = td.paged_decode_triton(q, k_fp, v_fp, tables, lens, scale, return_key_scores=True, num_splits=2,
                                     codec=codec, kq_pool=kq, vq_pool=vq)
    ref_out, ref_ks = td.paged_decode_triton(q, ref_k, ref_v, ref_tables, lens, scale, return_key_scores=True,
                                             num_splits=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(ks, ref_ks, **SCORE_TOL[dtype])
    positions = torch.zeros(ref_tables.shape[0], ref_tables.shape[1], ref_tables.shape[2] * block_size,
                            dtype=torch.int32, device=q.device)
    fp64_out, _ = reference_paged_attention(q, ref_k, ref_v, ref_tables, lens, positions,
                                            torch.zeros(q.shape[0], 1, dtype=torch.int32, device=q.device), scale)
    torch.testing.assert_close(out, fp64_out, **TOL[dtype])


def test_codec_without_a_kernel_is_refused():
    from kvbench.quant.codecs import Fp8Codec
    q = torch.zeros(1, 1, 1, 16)
    pool = torch.zeros(2, 16, 16)
    with pytest.raises(ValueError, match="triton_attention"):
        td.paged_decode_triton(q, pool, pool, torch.zeros(1, 1, 1, dtype=torch.int32),
                               torch.ones(1, 1, dtype=torch.int64), 1.0, codec=Fp8Codec(),
                               kq_pool=torch.zeros(1, 64, dtype=torch.uint8), vq_pool=torch.zeros(1, 64, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------- the engine on this path
@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in capture (on a GPU, bench/gpu_check.py runs real graphs)")
def test_engine_on_the_triton_decode_from_graphs():
    """The GPU decode path end to end, interpreted (one small case: the interpreter is slow): Triton attention
    (split-KV decode reading packed KIVI blocks in place), PagedEviction's device-side block eviction, decode steps
    from graphs (stand-in capture: no host sync inside) give the torch reference's greedy tokens."""
    from kvbench.methods import build_method
    from kvbench.quant.registry import build_codec
    from kvbench.runtime.serving import decode_graphs as dg
    from kvbench.runtime.serving.engine import Engine
    from tests.tiny_models import tiny_model

    model = tiny_model(vocab=128, hidden=64, heads=4, kv_heads=1, layers=2, max_positions=256)
    prompts = [[(5 * i + 3) % 128 for i in range(n)] for n in (30, 17)]
    tokens = {}
    for backend in ("torch", "triton"):
        eng = Engine(model, build_method("paged_eviction", 16), codec=build_codec("kivi", model, group_size=8,
                                                                                   residual=8),
                     block_size=8, num_blocks=256, attention_backend=backend, prefill_chunk_size=64, max_num_seqs=2)
        if backend == "triton":
            eng.backend.num_splits = 1  # splits are the kernel tests' business; the interpreter is slow
            eng.use_decode_graphs(capture=dg.cpu_standin_capture)
        tokens[backend] = [g.token_ids for g in eng.generate(prompts, max_new_tokens=10)]
        if backend == "triton":
            assert eng.attention_backend == "triton" and eng.decode_graphs.replays > 0
            assert eng.cache.block_counts()["packed"] == 0 and eng.cache.pool.in_use == 0
    assert tokens["triton"] == tokens["torch"]
