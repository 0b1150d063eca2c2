"""The Triton paged-attention kernel against a plain torch reference (CPU: Triton interpreter, fp32 / fp16;
with KVBENCH_TEST_GPU=1 on a CUDA machine: the compiled kernel, bf16 too, as bench/gpu_check.sh runs it).

Every cache built here is poisoned where the kernel must not look: pool slots past a table's length and every pool
block no table owns hold NaN, unused block-table entries point at a NaN block, and key positions past the length
are 0 (visible to every query). A kernel that reads past a length or through an unused entry gives NaN or a wrong
row, never a pass.
"""

import os

ON_GPU = os.environ.get("KVBENCH_TEST_GPU") == "1"  # the compiled kernel on a CUDA GPU instead of the interpreter
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before importing any module that defines a @triton.jit kernel

import importlib.util  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from kvbench.runtime.backends.triton import attention as ta  # noqa: E402
from kvbench.runtime.backends.triton.attention import paged_attention_triton  # noqa: E402

if ON_GPU and not torch.cuda.is_available():  # pragma: no cover
    pytest.skip("KVBENCH_TEST_GPU=1 needs a CUDA GPU", allow_module_level=True)
if not ON_GPU and not ta._interpreting():  # pragma: no cover
    pytest.skip(
        "kvbench.runtime.backends.triton.attention was imported before TRITON_INTERPRET=1 was set; run this file "
        "alone",
        allow_module_level=True,
    )

DEVICE = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=5e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
SCORE_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-3, rtol=1e-3),
             torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}
# the interpreter's bf16 dot is wrong: bf16 runs on a GPU only
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="bf16: the compiled kernel on a GPU only (KVBENCH_TEST_GPU=1)")


# ----------------------------------------------------------------------------------------------------------------------
# plain torch reference: gather the table's blocks, mask, softmax, matmul (fp64)


def reference_paged_attention(q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions, scale):
    """Returns (out [B, H_q, Q, D] in q.dtype, key_scores fp32 [B, H_kv, max_blocks * block_size]), computed on the
    CPU in fp64 and returned on q's device."""
    device = q.device
    q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions = (
        t.cpu() for t in (q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions))
    B, H_q, Q, D = q.shape
    H_kv, max_blocks = block_tables.shape[1:]
    group = H_q // H_kv
    block_size = k_pool.shape[1]
    out = torch.zeros(B, H_q, Q, D, dtype=torch.float64)
    key_scores = torch.zeros(B, H_kv, max_blocks * block_size, dtype=torch.float64)
    for b in range(B):
        qpos = query_positions[b].long()  # [Q]
        for h in range(H_kv):
            L = int(lengths[b, h])
            slots = torch.arange(L)
            blocks = block_tables[b, h, slots // block_size].long()
            k = k_pool[blocks, slots % block_size].double()  # [L, D]
            v = v_pool[blocks, slots % block_size].double()  # [L, D]
            qg = q[b, h * group:(h + 1) * group].double()  # [G, Q, D]
            kpos = key_positions[b, h, :L].long()  # [L]
            visible = (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)  # [Q, L]
            scores = (qg @ k.T * scale).masked_fill(~visible, float("-inf"))  # [G, Q, L]
            p = torch.softmax(scores, dim=-1)
            p = torch.where(visible.any(-1)[None, :, None], p, torch.zeros_like(p))  # rows seeing nothing: 0
            out[b, h * group:(h + 1) * group] = p @ v
            key_scores[b, h, :L] = p.sum(dim=(0, 1))
    return out.to(q.dtype).to(device), key_scores.float().to(device)


# ----------------------------------------------------------------------------------------------------------------------
# building a poisoned paged cache


def make_case(lengths, num_queries, *, group, head_dim, block_size, dtype, seed=0,
              valid_queries=None, seq_lens=None, extra_blocks=1):
    """lengths: [B][H_kv] table lengths. Sequence b has seq_lens[b] tokens (default: its longest table); its
    valid_queries[b] (default num_queries) query tokens are its last ones, the rest of the Q rows are padding (-1).
    Each table keeps those newest tokens plus a random subset of the older ones (eviction per head)."""
    g = torch.Generator().manual_seed(seed)
    B, H_kv = len(lengths), len(lengths[0])
    valid_queries = valid_queries or [num_queries] * B
    seq_lens = seq_lens or [max(row) for row in lengths]
    max_blocks = max(math.ceil(L / block_size) for row in lengths for L in row) + 1  # one unused entry at least
    max_slots = max_blocks * block_size

    n_used = sum(math.ceil(L / block_size) for row in lengths for L in row)
    num_blocks = n_used + extra_blocks + 1
    perm = torch.randperm(num_blocks, generator=g)
    poison_block = int(perm[-1])
    k_pool = torch.randn(num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, block_size, head_dim, generator=g).to(dtype)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)

    block_tables = torch.full((B, H_kv, max_blocks), poison_block, dtype=torch.int32)
    key_positions = torch.zeros(B, H_kv, max_slots, dtype=torch.int32)
    query_positions = torch.full((B, num_queries), -1, dtype=torch.int32)
    next_block = 0
    for b in range(B):
        T, nq = seq_lens[b], valid_queries[b]
        query_positions[b, :nq] = torch.arange(T - nq, T, dtype=torch.int32)
        for h in range(H_kv):
            L = lengths[b][h]
            new = min(nq, L)
            older = torch.randperm(T - nq, generator=g)[: L - new].sort().values
            pos = torch.cat([older, torch.arange(T - new, T)])
            key_positions[b, h, :L] = pos.to(torch.int32)
            for j in range(math.ceil(L / block_size)):
                blk = int(perm[next_block])
                next_block += 1
                block_tables[b, h, j] = blk
                owned[blk, : min(block_size, L - j * block_size)] = True
    k_pool[~owned] = float("nan")
    v_pool[~owned] = float("nan")
    assert torch.isnan(k_pool).any() and torch.isnan(v_pool[poison_block]).all()

    q = torch.randn(B, H_kv * group, num_queries, head_dim, generator=g).to(dtype)
    lengths_t = torch.tensor(lengths, dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (q, k_pool, v_pool, block_tables, lengths_t, key_positions, query_positions))


def run_and_compare(case, *, scale=None, check_scores=True):
    q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions = case
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    out, key_scores = paged_attention_triton(*case, scale, return_key_scores=True)
    ref_out, ref_scores = reference_paged_attention(*case, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert key_scores.shape == key_positions.shape and key_scores.dtype == torch.float32
    assert torch.isfinite(out).all(), "NaN/inf in the output: the kernel read a poisoned slot"
    torch.testing.assert_close(out, ref_out, **TOL[q.dtype])
    if check_scores:
        torch.testing.assert_close(key_scores, ref_scores, **SCORE_TOL[q.dtype])
        # each row that sees a key hands out probability 1 in total: the per-table sum counts those rows
        group = q.shape[1] // lengths.shape[1]
        for b in range(q.shape[0]):
            for h in range(lengths.shape[1]):
                L = int(lengths[b, h])
                kpos = key_positions[b, h, :L].long()
                qpos = query_positions[b].long()
                rows_seeing = ((kpos[None, :] <= qpos[:, None]).any(-1) & (qpos >= 0)).sum().item() * group
                tol = 1e-3 if q.dtype == torch.bfloat16 else 1e-4
                assert key_scores[b, h].sum().item() == pytest.approx(rows_seeing, rel=tol, abs=tol)
                assert (key_scores[b, h, L:] == 0).all()
    # the plain call returns only the output, identical to the one with scores
    out_only = paged_attention_triton(*case, scale)
    assert isinstance(out_only, torch.Tensor)
    torch.testing.assert_close(out_only, out, atol=0, rtol=0)
    return out, key_scores


# ----------------------------------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize(
    "block_size,head_dim,group,dtype",
    [
        (16, 64, 1, torch.float32),
        (8, 32, 3, torch.float16),
        (16, 32, 4, torch.float16),
        (8, 64, 4, torch.float32),
        (16, 48, 2, torch.float32),  # head_dim not a power of two
        pytest.param(16, 64, 3, torch.bfloat16, marks=GPU_ONLY),
    ],
)
def test_decode_ragged(block_size, head_dim, group, dtype):
    # ragged across batch and heads: a long table, an exact multiple of block_size, a 1-slot table, a short one
    lengths = [[37, 5], [16, 1]]
    case = make_case(lengths, 1, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=block_size + head_dim + group)
    out, key_scores = run_and_compare(case)
    # decode sees every slot of every table (the newest token's position is the largest): all slots score > 0
    lengths_t = case[4]
    for b in range(2):
        for h in range(2):
            assert (key_scores[b, h, : int(lengths_t[b, h])] > 0).all()


@pytest.mark.parametrize(
    "num_queries,block_size,head_dim,group,dtype",
    [
        (5, 16, 64, 1, torch.float32),
        (17, 8, 32, 3, torch.float16),
        (33, 8, 32, 4, torch.float32),  # 132 rows: three query tiles share each table (atomics on the scores)
        (9, 16, 64, 4, torch.float16),
        pytest.param(33, 16, 64, 3, torch.bfloat16, marks=GPU_ONLY),
    ],
)
def test_chunked_prefill(num_queries, block_size, head_dim, group, dtype):
    # sequence 0: a chunk of num_queries new tokens after an evicted history, different per head;
    # sequence 1: a shorter chunk (padded query rows at -1) on ragged tables
    Q = num_queries
    lengths = [[Q + 20, Q + 3], [Q - 2, Q + 9]]
    case = make_case(lengths, Q, group=group, head_dim=head_dim, block_size=block_size, dtype=dtype,
                     seed=Q, valid_queries=[Q, Q - 2], seq_lens=[Q + 40, Q + 12])
    out, _ = run_and_compare(case)
    assert (out[1, :, Q - 2:] == 0).all(), "padded query rows must be zero"


def test_causal_mask_matters():
    # the kernel's output for a chunk differs from what full (non-causal) attention over the same table would give
    Q = 6
    case = make_case([[14]], Q, group=2, head_dim=32, block_size=8, dtype=torch.float32, seed=7)
    q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions = case
    out = paged_attention_triton(*case, 0.2)
    all_visible = torch.full_like(query_positions, 10_000)
    ref_noncausal, _ = reference_paged_attention(q, k_pool, v_pool, block_tables, lengths, key_positions,
                                                 all_visible, 0.2)
    ref_causal, _ = reference_paged_attention(*case, 0.2)
    torch.testing.assert_close(out, ref_causal, **TOL[torch.float32])
    assert not torch.allclose(out[..., :-1, :], ref_noncausal[..., :-1, :], atol=1e-3)
    torch.testing.assert_close(out[..., -1, :], ref_noncausal[..., -1, :], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fully_masked_rows(dtype):
    # table (0, 0): keys at positions 10..21 (older ones evicted); queries at 3 (sees nothing), 15, 21 and padding.
    # table (0, 1): empty. Every row of kv head 1 and the row at position 3 must come out exactly zero.
    group, D, bs = 2, 32, 8
    case = make_case([[12, 0]], 4, group=group, head_dim=D, block_size=bs, dtype=dtype, seed=3)
    q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions = case
    key_positions[0, 0, :12] = torch.arange(10, 22, dtype=torch.int32)
    query_positions[0] = torch.tensor([3, 15, 21, -1], dtype=torch.int32)
    out, key_scores = run_and_compare(case)
    assert (out[0, :, 0] == 0).all()  # position 3: no visible key
    assert (out[0, :, 3] == 0).all()  # padded row
    assert (out[0, group:] == 0).all()  # empty table
    assert (key_scores[0, 1] == 0).all()
    assert (out[0, :group, 1:3].abs().sum(-1) > 0).all()  # the rows that do see keys are not zero
    # keys at positions 10..15 get all of the query at 15 and part of the one at 21; keys 16..21 only the rest
    assert key_scores[0, 0, :6].sum().item() > group > key_scores[0, 0, 6:12].sum().item() > 0


def test_strided_inputs():
    # q as a transposed view of [B, Q, H_q, D] (what a projection gives) and a pool that is a slice of a bigger
    # tensor, e.g. one layer of [layers, num_blocks, block_size, D]: strides are honoured, no copy needed.
    case = make_case([[21, 9], [3, 30]], 3, group=2, head_dim=32, block_size=8, dtype=torch.float32, seed=11)
    q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions = case
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H_q, Q, D] with strides of [B, Q, H_q, D]
    k_layers = torch.stack([torch.zeros_like(k_pool), k_pool])
    v_layers = torch.stack([v_pool, torch.zeros_like(v_pool)])
    assert not q_t.is_contiguous()
    out = paged_attention_triton(q_t, k_layers[1], v_layers[0], block_tables, lengths, key_positions,
                                 query_positions, 0.125)
    ref, _ = reference_paged_attention(*case, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_int64_index_tensors():
    # int64 lengths / positions / tables (what torch code builds by default) give the same result as int32
    case = make_case([[19, 4], [11, 26]], 3, group=2, head_dim=32, block_size=8, dtype=torch.float16, seed=13)
    out32, ks32 = paged_attention_triton(*case, 0.2, return_key_scores=True)
    case64 = list(case[:3]) + [t.long() for t in case[3:]]
    out64, ks64 = paged_attention_triton(*case64, 0.2, return_key_scores=True)
    ref, ref_scores = reference_paged_attention(*case, 0.2)
    torch.testing.assert_close(out64, ref, **TOL[torch.float16])
    torch.testing.assert_close(ks64, ref_scores, **SCORE_TOL[torch.float16])
    torch.testing.assert_close(out64, out32, atol=0, rtol=0)


def test_tile_sizes_agree():
    # the result does not depend on the tiling (a key tile smaller or larger than a pool block, several query tiles)
    case = make_case([[40, 17]], 7, group=3, head_dim=32, block_size=16, dtype=torch.float32, seed=5)
    a, sa = paged_attention_triton(*case, 0.2, return_key_scores=True, block_m=16, block_n=16)
    b, sb = paged_attention_triton(*case, 0.2, return_key_scores=True, block_m=32, block_n=64)
    ref, ref_scores = reference_paged_attention(*case, 0.2)
    torch.testing.assert_close(a, ref, **TOL[torch.float32])
    torch.testing.assert_close(b, ref, **TOL[torch.float32])
    torch.testing.assert_close(sa, ref_scores, **SCORE_TOL[torch.float32])
    torch.testing.assert_close(sb, ref_scores, **SCORE_TOL[torch.float32])


def _good_case():
    return list(make_case([[5, 3]], 2, group=2, head_dim=16, block_size=8, dtype=torch.float32, seed=1))


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda c: c.__setitem__(3, c[3].short()), TypeError, "block_tables must be int32"),
        (lambda c: c.__setitem__(6, c[6].float()), TypeError, "query_positions must be int32"),
        (lambda c: c.__setitem__(1, c[1].half()), TypeError, "share one dtype"),
        (lambda c: c.__setitem__(0, c[0][:, :3]), ValueError, "multiple of H_kv"),
        (lambda c: c.__setitem__(0, c[0][..., :8]), ValueError, "head_dim mismatch"),
        (lambda c: c.__setitem__(5, c[5][..., :-1]), ValueError, "key_positions must be"),
        (lambda c: c.__setitem__(4, c[4][:, :1]), ValueError, "lengths must be"),
        (lambda c: c.__setitem__(1, c[1].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         "k_pool must have a contiguous last dim"),
        (lambda c: c.__setitem__(2, c[2][:, :4]), ValueError, "v_pool shape"),
    ],
)
def test_wrapper_rejects_bad_inputs(mutate, error, match):
    case = _good_case()
    paged_attention_triton(*case, 0.25)  # the unmutated case runs
    mutate(case)
    with pytest.raises(error, match=match):
        paged_attention_triton(*case, 0.25)


def _load_fresh_copy(name):
    spec = importlib.util.spec_from_file_location(name, ta.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(ON_GPU, reason="on a GPU machine the compiled kernel is what runs")
def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    # imported without TRITON_INTERPRET the kernel is compiled for a GPU: CPU tensors get a clear error
    # instead of triton's "0 active drivers"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module = _load_fresh_copy("_kvbench_ta_compiled")
    assert not module._interpreting()
    with pytest.raises(RuntimeError, match="need a GPU.*TRITON_INTERPRET=1"):
        module.paged_attention_triton(*_good_case(), 0.25)


def test_import_without_triton_fails_only_when_called(monkeypatch):
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    module = _load_fresh_copy("_kvbench_ta_no_triton")  # importing works
    with pytest.raises(ImportError, match="needs triton"):
        module.paged_attention_triton(*_good_case(), 0.25)
