"""Paged attention as a Triton kernel (decode, chunked prefill and multi-token scoring share it).

Layout (one layer; the torch reference in ``kvbench.runtime.backends.torch.attention`` has the same semantics):
    q               [B, H_q, Q, D]                 fp32 / fp16 / bf16, H_q = H_kv * group
    k_pool, v_pool  [num_blocks, block_size, D]    same dtype as q; one block = block_size consecutive slots
                                                   of ONE (sequence, kv-head) table
    block_tables    int32 [B, H_kv, max_blocks]    physical block of each table, in slot order
    lengths         int32 [B, H_kv]                valid slots of each table (0..len-1)
    key_positions   int32 [B, H_kv, max_blocks * block_size]   original token position of each slot
    query_positions int32 [B, Q]                   position of each query token; -1 = padded row
    (int64 is accepted for the four index tensors too; any strides are honoured for them)

Key slot s is visible to query i of (b, h) iff s < lengths[b, h] and key_positions[b, h, s] <= query_positions[b, i].
Rows with no visible key (and padded rows) give zeros.

One program = one (sequence, kv-head) table x one tile of BLOCK_M rows, where the rows are the (query, head) pairs
of the whole GQA group flattened query-major (row r = query r // group, head r % group), so each K/V tile is read
once per group and query tile. The program walks the table BLOCK_N slots at a time (a tile may span several pool
blocks: the block id is gathered per slot, so any block_size works) with an online softmax in fp32.

With ``return_key_scores=True`` a second walk over the same table recomputes q k^T, normalizes it with the rows'
final max and sum, and adds each slot's column sum (over the query heads of the group and over the queries) into an
fp32 [B, H_kv, max_blocks * block_size] buffer with atomics: the attention matrix is never stored.

triton is imported lazily: importing this module without triton works, calling the kernel raises ImportError.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing this module (tests do; slow, fp32/fp16 only).
"""

from __future__ import annotations

import torch

try:  # triton is an optional dependency
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    _TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover - exercised by a test that hides triton
    triton = None
    tl = None
    InterpretedFunction = None
    _TRITON_IMPORT_ERROR = _err

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        Q, K, V, BT, LEN, KPOS, QPOS, O, KS,
        scale_log2,  # softmax scale * log2(e): the kernel works in base 2
        num_queries,  # Q
        max_slots,  # max_blocks * block_size
        s_qb, s_qh, s_qq, s_qd,
        s_kn, s_ks, s_kd,
        s_vn, s_vs, s_vd,
        s_btb, s_bth, s_btj,
        s_lb, s_lh,
        s_pb, s_ph, s_ps,
        s_qpb, s_qpq,
        s_ob, s_oh, s_oq, s_od,
        s_sb, s_sh, s_ss,
        H_KV: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        RETURN_SCORES: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        b = pid_bh // H_KV
        h = pid_bh % H_KV

        # rows of this tile: (query qi, head g of the group), query-major
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        qi = rows // GROUP
        g = rows % GROUP
        in_range = qi < num_queries
        qpos = tl.load(QPOS + b * s_qpb + qi * s_qpq, mask=in_range, other=-1)
        row_ok = in_range & (qpos >= 0)  # padded query rows see nothing
        head = h * GROUP + g

        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_ptrs = Q + b * s_qb + head[:, None] * s_qh + qi[:, None] * s_qq + d[None, :] * s_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

        length = tl.load(LEN + b * s_lb + h * s_lh)
        length = tl.minimum(length, max_slots)
        bt_base = BT + b * s_btb + h * s_bth
        kpos_base = KPOS + b * s_pb + h * s_ph

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # logical slots of the table
            n_ok = n < length
            blk = tl.load(bt_base + (n // BLOCK_SIZE) * s_btj, mask=n_ok, other=0).to(tl.int64)
            off = n % BLOCK_SIZE
            kt = tl.load(  # K^T tile [BLOCK_D, BLOCK_N]
                K + blk[None, :] * s_kn + off[None, :] * s_ks + d[:, None] * s_kd,
                mask=n_ok[None, :] & d_ok[:, None], other=0.0,
            )
            kpos = tl.load(kpos_base + n * s_ps, mask=n_ok, other=0)
            s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N] fp32
            visible = row_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: avoid inf - inf
            alpha = tl.math.exp2(m_i - m_safe)
            p = tl.math.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)

            v = tl.load(  # [BLOCK_N, BLOCK_D]
                V + blk[:, None] * s_vn + off[:, None] * s_vs + d[None, :] * s_vd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]  # rows with no visible key: acc == 0
        o_ptrs = O + b * s_ob + head[:, None] * s_oh + qi[:, None] * s_oq + d[None, :] * s_od
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=in_range[:, None] & d_ok[None, :])

        if RETURN_SCORES:
            # second walk: p = exp2(s - m) / l with the rows' final statistics, summed over rows per slot
            m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
            inv_l = tl.where(l_i > 0.0, 1.0 / l_safe, 0.0)
            ks_base = KS + b * s_sb + h * s_sh
            for start in range(0, length, BLOCK_N):
                n = start + tl.arange(0, BLOCK_N)
                n_ok = n < length
                blk = tl.load(bt_base + (n // BLOCK_SIZE) * s_btj, mask=n_ok, other=0).to(tl.int64)
                off = n % BLOCK_SIZE
                kt = tl.load(
                    K + blk[None, :] * s_kn + off[None, :] * s_ks + d[:, None] * s_kd,
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0,
                )
                kpos = tl.load(kpos_base + n * s_ps, mask=n_ok, other=0)
                s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * scale_log2
                visible = row_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
                s = tl.where(visible, s, float("-inf"))
                p = tl.math.exp2(s - m_fin[:, None]) * inv_l[:, None]
                tl.atomic_add(ks_base + n * s_ss, tl.sum(p, 0), mask=n_ok)


def _interpreting() -> bool:
    """Whether the kernel was built for the Triton interpreter (TRITON_INTERPRET=1 when this module was imported)."""
    return isinstance(_paged_attention_kernel, InterpretedFunction)


def _check_inputs(q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, H_q, Q, D], got shape {tuple(q.shape)}")
    if k_pool.dim() != 3:
        raise ValueError(f"k_pool must be [num_blocks, block_size, D], got shape {tuple(k_pool.shape)}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool shape {tuple(v_pool.shape)} != k_pool shape {tuple(k_pool.shape)}")
    B, H_q, _, D = q.shape
    _, block_size, D_pool = k_pool.shape
    if D_pool != D:
        raise ValueError(f"head_dim mismatch: q has {D}, k_pool/v_pool have {D_pool}")
    if block_tables.dim() != 3 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be [B={B}, H_kv, max_blocks], got shape {tuple(block_tables.shape)}")
    H_kv, max_blocks = block_tables.shape[1], block_tables.shape[2]
    if H_kv == 0 or H_q % H_kv != 0:
        raise ValueError(f"H_q={H_q} query heads must be a multiple of H_kv={H_kv} kv heads (GQA)")
    if tuple(lengths.shape) != (B, H_kv):
        raise ValueError(f"lengths must be [B, H_kv] = {(B, H_kv)}, got {tuple(lengths.shape)}")
    if tuple(key_positions.shape) != (B, H_kv, max_blocks * block_size):
        raise ValueError(
            f"key_positions must be [B, H_kv, max_blocks * block_size] = {(B, H_kv, max_blocks * block_size)}, "
            f"got {tuple(key_positions.shape)}"
        )
    if tuple(query_positions.shape) != (B, q.shape[2]):
        raise ValueError(f"query_positions must be [B, Q] = {(B, q.shape[2])}, got {tuple(query_positions.shape)}")

    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q dtype {q.dtype} not supported (fp32, fp16, bf16)")
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        raise TypeError(f"q, k_pool, v_pool must share one dtype, got {q.dtype}, {k_pool.dtype}, {v_pool.dtype}")
    for name, t in (("block_tables", block_tables), ("lengths", lengths),
                    ("key_positions", key_positions), ("query_positions", query_positions)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32 (or int64), got {t.dtype}")

    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool)):
        if t.numel() > 0 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")

    dev = q.device
    for name, t in (("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", block_tables), ("lengths", lengths),
                    ("key_positions", key_positions), ("query_positions", query_positions)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}, q on {dev}: all inputs must be on one device")
    if dev.type == "cpu" and not _interpreting():
        raise RuntimeError(
            "paged_attention_triton got CPU tensors: Triton kernels need a GPU. On CPU set TRITON_INTERPRET=1 "
            "before importing kvbench.runtime.backends.triton.attention (slow, for tests; fp32/fp16 only), or use "
            "the torch reference in kvbench.runtime.backends.torch.attention."
        )


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    return_key_scores: bool = False,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v over a paged cache; see the module docstring for the layout.

    Returns out [B, H_q, Q, D] in q's dtype, and with ``return_key_scores`` also key_scores fp32
    [B, H_kv, max_blocks * block_size]: the probability each slot received, summed over the group's query heads
    and the Q queries (0 past the table's length). block_m / block_n / num_warps / num_stages are tuning knobs.
    """
    if _TRITON_IMPORT_ERROR is not None:
        raise ImportError(
            "paged_attention_triton needs triton (pip install triton); use the torch reference "
            "kvbench.runtime.backends.torch.attention instead"
        ) from _TRITON_IMPORT_ERROR
    _check_inputs(q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions)

    B, H_q, num_queries, D = q.shape
    _, block_size, _ = k_pool.shape
    H_kv, max_blocks = block_tables.shape[1], block_tables.shape[2]
    group = H_q // H_kv
    max_slots = max_blocks * block_size

    out = torch.empty((B, H_q, num_queries, D), dtype=q.dtype, device=q.device)  # [B, H_q, Q, D]
    key_scores = (
        torch.zeros((B, H_kv, max_slots), dtype=torch.float32, device=q.device) if return_key_scores else None
    )
    if out.numel() == 0:
        return (out, key_scores) if return_key_scores else out
    if max_slots == 0:  # no cache at all: every row sees nothing
        out.zero_()
        return (out, key_scores) if return_key_scores else out

    rows = num_queries * group
    if block_m is None:
        block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if block_n is None:
        block_n = 32 if block_m <= 16 else 64  # a tile may span several pool blocks (or part of one)
    if block_m < 16 or block_n < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m={block_m} and block_n={block_n} must be powers of two >= 16 (tl.dot)")
    block_d = max(16, triton.next_power_of_2(D))
    if num_warps is None:
        num_warps = 4 if block_m * block_d <= 64 * 64 else 8
    if num_stages is None:
        num_stages = 2
    # fp32 inputs: exact fp32 products (a tf32 dot would differ from the reference by ~1e-3 relative)
    input_precision = "ieee" if q.dtype == torch.float32 else None

    ks = key_scores if key_scores is not None else out  # dummy pointer when not returning scores
    ks_strides = key_scores.stride() if key_scores is not None else (0, 0, 0)
    grid = (B * H_kv, triton.cdiv(rows, block_m))
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, block_tables, lengths, key_positions, query_positions, out, ks,
        float(scale) * _LOG2E, num_queries, max_slots,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *block_tables.stride(), *lengths.stride(),
        *key_positions.stride(), *query_positions.stride(), *out.stride(), *ks_strides,
        H_KV=H_kv, GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        RETURN_SCORES=return_key_scores, INPUT_PRECISION=input_precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return (out, key_scores) if return_key_scores else out


__all__ = ["paged_attention_triton"]
