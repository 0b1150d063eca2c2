"""Split-KV ("flash-decoding") paged decode attention in Triton, over full-precision or codec-packed blocks.

One query token per sequence (a decode step), every cached key visible (no position mask):

    q               [B, H_q, 1, D]                 fp32 / fp16 / bf16, H_q = H_kv * group
    k_pool, v_pool  [num_fp, block_size, D]        full-precision blocks (any float dtype; cast to q's for the dots)
    block_tables    int32 [B, H_kv, max_blocks]    physical block of each table, in slot order
    lengths         int [B, H_kv]                  valid slots of each table (0 = empty: output zeros)
    codec (optional) packed rows kq_pool [num_packed, key_bytes], vq_pool [num_packed, value_bytes] uint8, read
                    as the codec's `affine_rows` says; a table entry >= num_fp is packed row (entry - num_fp)

Two stages, as SGLang's and vLLM's Triton decode (the design only; this code is kvbench's own):
  stage 1, grid (B * H_kv, num_splits): each program takes one (sequence, kv-head) table and one contiguous range
      of its slots (split s of `num_splits`, ranges rounded to BLOCK_N), runs the online softmax over it with the
      GROUP query heads of the kv-head as the rows of one tile (one K/V read per group), and writes its partial
      output (normalized) and its log-sum-exp (base 2) per row; an empty range writes lse = -inf.
  stage 2, grid (B * H_q,): merges the splits of each row with weights exp2(lse_s - max) and writes the output and
      the row's final log-sum-exp.
  scores (only with return_key_scores), grid (B * H_kv, num_splits): recomputes q k^T over the same ranges and
      writes each slot's attention mass exp2(s - lse) summed over the group's rows: each slot is owned by one
      program (a plain store, no atomics), and the attention matrix is never stored.

Packed blocks are decoded in registers as their tiles are loaded (code -> mn + code * scale, or code * scale for
signed codes), never into a dense copy in memory: a packed K/V tile costs its code bytes plus its statistics.

`num_splits`: `default_num_splits` picks it from the device's SM count and the tables' capacity (a fixed value may
be passed, as the tests do; a CUDA graph captures one value per batch bucket). The grid never depends on the
lengths' values, so a launch needs no host sync.

triton is imported lazily: importing this module without triton works, calling the kernels raises ImportError.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing this module (tests do; fp32/fp16 only).
"""
from __future__ import annotations

import functools

import torch

# triton and triton.language, or None without triton (the guarded import lives in attention.py)
from kvbench.runtime.backends.triton.attention import _TRITON_IMPORT_ERROR, tl, triton

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


if triton is not None:

    @triton.jit
    def _load_tile(
        POOL, QPOOL, QHALF, blk, off, n_ok, d, d_ok,
        s_pn, s_ps, s_pd, num_fp, row_bytes, codes_off, mn_off, scale_off, n_groups_d,
        HEAD_DIM: tl.constexpr, CODEC: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
        PER_CHANNEL: tl.constexpr, GROUP_Q: tl.constexpr,
    ):
        """A [BLOCK_N, BLOCK_D] fp32 tile of K or V: slot i is offset off[i] of block blk[i] (masked by n_ok)."""
        mask = n_ok[:, None] & d_ok[None, :]
        if CODEC:
            is_fp = blk < num_fp
            fp_mask = mask & is_fp[:, None]
            pk_mask = mask & (blk >= num_fp)[:, None]
            fp_blk = tl.where(is_fp, blk, 0)
            x = tl.load(POOL + fp_blk[:, None] * s_pn + off[:, None] * s_ps + d[None, :] * s_pd,
                        mask=fp_mask, other=0.0).to(tl.float32)
            row = tl.where(is_fp, 0, blk - num_fp).to(tl.int64)
            e = off[:, None] * HEAD_DIM + d[None, :]  # code number inside the block
            byte = tl.load(QPOOL + row[:, None] * row_bytes + codes_off + (e * BITS) // 8, mask=pk_mask,
                           other=0).to(tl.int32)
            code = (byte >> ((e * BITS) % 8)) & ((1 << BITS) - 1)
            if SIGNED:
                code = tl.where(code >= (1 << (BITS - 1)), code - (1 << BITS), code)
            if PER_CHANNEL:
                stat = (off[:, None] // GROUP_Q) * HEAD_DIM + d[None, :]
            else:
                stat = off[:, None] * n_groups_d + d[None, :] // GROUP_Q
            half_row = row[:, None] * (row_bytes // 2)
            scale = tl.load(QHALF + half_row + scale_off + stat, mask=pk_mask, other=0.0).to(tl.float32)
            deq = code.to(tl.float32) * scale
            if not SIGNED:  # unsigned codes carry a minimum (signed ones are symmetric: no mn)
                deq += tl.load(QHALF + half_row + mn_off + stat, mask=pk_mask, other=0.0).to(tl.float32)
            x = tl.where(pk_mask, deq, x)
        else:
            x = tl.load(POOL + blk[:, None] * s_pn + off[:, None] * s_ps + d[None, :] * s_pd, mask=mask,
                        other=0.0).to(tl.float32)
        return x

    @triton.jit
    def _group_queries(Q, s_qb, s_qh, s_qd, H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                       BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's (sequence, kv-head, split) and its GROUP query heads' rows q [BLOCK_G, BLOCK_D]."""
        pid_bh = tl.program_id(0)
        b = pid_bh // H_KV
        h = pid_bh % H_KV
        g = tl.arange(0, BLOCK_G)
        g_ok = g < GROUP
        head = h * GROUP + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + b * s_qb + head[:, None] * s_qh + d[None, :] * s_qd,
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        return b, h, tl.program_id(1), g_ok, head, d, d_ok, q

    @triton.jit
    def _tile_slots(bt_base, s0, end, s_btj, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Slots s0.. of a table's range (n, n < end) and their (block id, offset in the block)."""
        n = s0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        blk = tl.load(bt_base + (n // BLOCK_SIZE) * s_btj, mask=n_ok, other=0).to(tl.int64)
        return n, n_ok, blk, n % BLOCK_SIZE

    @triton.jit
    def _scores_tile(q, K, KQ, KQH, blk, off, n_ok, d, d_ok, s_kn, s_ks, s_kd, num_fp, k_row_bytes, k_codes_off,
                     k_mn_off, k_scale_off, k_groups_d, scale_log2, HEAD_DIM: tl.constexpr, CODEC: tl.constexpr,
                     K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_PER_CHANNEL: tl.constexpr,
                     K_GROUP: tl.constexpr, INPUT_PRECISION: tl.constexpr):
        """q k^T * scale * log2(e) [BLOCK_G, BLOCK_N] for one tile of slots."""
        k = _load_tile(K, KQ, KQH, blk, off, n_ok, d, d_ok, s_kn, s_ks, s_kd, num_fp,
                       k_row_bytes, k_codes_off, k_mn_off, k_scale_off, k_groups_d,
                       HEAD_DIM, CODEC, K_BITS, K_SIGNED, K_PER_CHANNEL, K_GROUP)
        return tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION) * scale_log2

    @triton.jit
    def _split_range(LEN, BT, b, h, split, s_lb, s_lh, s_btb, s_bth, max_slots,
                     NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """(first slot, end slot, table base pointer) of this program's split of table (b, h)."""
        length = tl.minimum(tl.load(LEN + b * s_lb + h * s_lh).to(tl.int32), max_slots)
        per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, length)
        return start, end, BT + b * s_btb + h * s_bth

    @triton.jit
    def _decode_stage1(
        Q, K, V, KQ, VQ, KQH, VQH, BT, LEN, MID_O, MID_LSE,
        scale_log2, max_slots, num_fp,
        s_qb, s_qh, s_qd,
        s_kn, s_ks, s_kd, s_vn, s_vs, s_vd,
        s_btb, s_bth, s_btj, s_lb, s_lh,
        k_row_bytes, k_codes_off, k_mn_off, k_scale_off, k_groups_d,
        v_row_bytes, v_codes_off, v_mn_off, v_scale_off, v_groups_d,
        H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        CODEC: tl.constexpr,
        K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_PER_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr,
        V_BITS: tl.constexpr, V_SIGNED: tl.constexpr, V_PER_CHANNEL: tl.constexpr, V_GROUP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        b, h, split, g_ok, head, d, d_ok, q = _group_queries(Q, s_qb, s_qh, s_qd, H_KV, GROUP, HEAD_DIM, BLOCK_G,
                                                             BLOCK_D)
        start, end, bt_base = _split_range(LEN, BT, b, h, split, s_lb, s_lh, s_btb, s_bth, max_slots,
                                           NUM_SPLITS, BLOCK_N)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for s0 in range(start, end, BLOCK_N):
            n, n_ok, blk, off = _tile_slots(bt_base, s0, end, s_btj, BLOCK_SIZE, BLOCK_N)
            s = _scores_tile(q, K, KQ, KQH, blk, off, n_ok, d, d_ok, s_kn, s_ks, s_kd, num_fp, k_row_bytes,
                             k_codes_off, k_mn_off, k_scale_off, k_groups_d, scale_log2, HEAD_DIM, CODEC, K_BITS,
                             K_SIGNED, K_PER_CHANNEL, K_GROUP, INPUT_PRECISION)  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)  # m_i = -inf at first: 0 (m_new is finite: n_ok has a slot)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_tile(V, VQ, VQH, blk, off, n_ok, d, d_ok, s_vn, s_vs, s_vd, num_fp,
                           v_row_bytes, v_codes_off, v_mn_off, v_scale_off, v_groups_d,
                           HEAD_DIM, CODEC, V_BITS, V_SIGNED, V_PER_CHANNEL, V_GROUP)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)
            m_i = m_new

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        row = (b * (H_KV * GROUP) + head) * NUM_SPLITS + split  # MID_O [B, H_q, NUM_SPLITS, D], contiguous
        tl.store(MID_O + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None],
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(MID_LSE + row, lse, mask=g_ok)

    @triton.jit
    def _decode_stage2(
        MID_O, MID_LSE, O, LSE, s_ob, s_oh, s_od,
        H_Q: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        pid = tl.program_id(0)  # one (sequence, query head) row
        b = pid // H_Q
        hq = pid % H_Q
        sp = tl.arange(0, BLOCK_S)
        sp_ok = sp < NUM_SPLITS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        lse = tl.load(MID_LSE + pid * NUM_SPLITS + sp, mask=sp_ok, other=float("-inf"))  # [BLOCK_S]
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.math.exp2(lse - m_safe)  # empty splits: 0
        total = tl.sum(w, 0)
        part = tl.load(MID_O + (pid * NUM_SPLITS + sp)[:, None] * HEAD_DIM + d[None, :],
                       mask=sp_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
        out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
        tl.store(O + b * s_ob + hq * s_oh + d * s_od, out.to(O.dtype.element_ty), mask=d_ok)
        tl.store(LSE + pid, tl.where(total > 0.0, m_safe + tl.math.log2(tl.where(total > 0.0, total, 1.0)),
                                     float("-inf")))

    @triton.jit
    def _decode_scores(
        Q, K, KQ, KQH, BT, LEN, LSE, KS,
        scale_log2, max_slots, num_fp,
        s_qb, s_qh, s_qd, s_kn, s_ks, s_kd,
        s_btb, s_bth, s_btj, s_lb, s_lh, s_sb, s_sh, s_ss,
        k_row_bytes, k_codes_off, k_mn_off, k_scale_off, k_groups_d,
        H_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        CODEC: tl.constexpr,
        K_BITS: tl.constexpr, K_SIGNED: tl.constexpr, K_PER_CHANNEL: tl.constexpr, K_GROUP: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        b, h, split, g_ok, head, d, d_ok, q = _group_queries(Q, s_qb, s_qh, s_qd, H_KV, GROUP, HEAD_DIM, BLOCK_G,
                                                             BLOCK_D)
        lse = tl.load(LSE + b * (H_KV * GROUP) + head, mask=g_ok, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # padded rows: exp2(s - inf) = 0
        start, end, bt_base = _split_range(LEN, BT, b, h, split, s_lb, s_lh, s_btb, s_bth, max_slots,
                                           NUM_SPLITS, BLOCK_N)
        for s0 in range(start, end, BLOCK_N):
            n, n_ok, blk, off = _tile_slots(bt_base, s0, end, s_btj, BLOCK_SIZE, BLOCK_N)
            s = _scores_tile(q, K, KQ, KQH, blk, off, n_ok, d, d_ok, s_kn, s_ks, s_kd, num_fp, k_row_bytes,
                             k_codes_off, k_mn_off, k_scale_off, k_groups_d, scale_log2, HEAD_DIM, CODEC, K_BITS,
                             K_SIGNED, K_PER_CHANNEL, K_GROUP, INPUT_PRECISION)  # [BLOCK_G, BLOCK_N]
            p = tl.math.exp2(s - lse[:, None])
            p = tl.where(g_ok[:, None] & n_ok[None, :], p, 0.0)
            tl.store(KS + b * s_sb + h * s_sh + n * s_ss, tl.sum(p, 0), mask=n_ok)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_num_splits(device: torch.device, batch: int, num_kv_heads: int, max_slots: int,
                       block_n: int = 64) -> int:
    """Splits per table: enough (sequence, kv-head, split) programs to fill the GPU about twice over (SM count x 2),
    at most one per BLOCK_N slots of the tables' capacity, at most MAX_SPLITS; 4 off CUDA (tests pass their own)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    programs = batch * num_kv_heads
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    by_length = max(1, -(-max_slots // (4 * block_n)))  # at least 4 tiles of work per split
    return int(max(1, min(MAX_SPLITS, -(-target // max(1, programs)), by_length)))


def _packed_args(codec, kind: str, block_size: int, head_dim: int) -> tuple[tuple, dict]:
    """Runtime (row_bytes, codes_off, mn_off in halves or -1, scale_off in halves, groups per row) and constexprs
    of a codec's packed rows; zeros for a full-precision cache."""
    if codec is None:
        return (0, 0, -1, 0, 1), dict(BITS=8, SIGNED=False, PER_CHANNEL=False, GROUP=1)
    rows = codec.affine_rows(kind, block_size, head_dim)
    if rows is None:
        raise ValueError(f"codec {getattr(codec, 'name', codec)!r} describes no affine rows for the Triton kernel")
    if rows.row_bytes % 2 or rows.scale_offset % 2 or (rows.mn_offset >= 0 and rows.mn_offset % 2):
        raise ValueError("packed rows must keep their fp16 statistics 2-byte aligned")
    if rows.signed != (rows.mn_offset < 0):
        raise ValueError("the Triton decode reads unsigned codes with a minimum or signed codes without one")
    mn = rows.mn_offset // 2 if rows.mn_offset >= 0 else -1
    return ((rows.row_bytes, rows.codes_offset, mn, rows.scale_offset // 2, -(-head_dim // rows.group)),
            dict(BITS=rows.bits, SIGNED=rows.signed, PER_CHANNEL=rows.per_channel, GROUP=rows.group))


def codec_readable(codec) -> bool:
    """Whether the Triton decode kernel reads this codec's packed rows (the codec lists "triton_attention")."""
    return "triton_attention" in getattr(codec, "kernels", ())


def paged_decode_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    return_key_scores: bool = False,
    num_splits: int | None = None,
    codec=None,
    kq_pool: torch.Tensor | None = None,
    vq_pool: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention (one query per sequence, every cached slot visible) over a paged cache, split-KV.

    Returns (out [B, H_q, 1, D] in q's dtype, key_scores fp32 [B, H_kv, max_blocks * block_size] or None: the
    probability each slot received, summed over the group's query heads; 0 past a table's length). With `codec`,
    table entries >= k_pool.shape[0] are rows of kq_pool / vq_pool (see the module docstring)."""
    if _TRITON_IMPORT_ERROR is not None:
        raise ImportError("paged_decode_triton needs triton (pip install triton)") from _TRITON_IMPORT_ERROR
    B, H_q, Qn, D = q.shape
    if Qn != 1:
        raise ValueError(f"paged_decode_triton takes one query per sequence, got Q={Qn}")
    num_fp, block_size, D_pool = k_pool.shape
    if D_pool != D or v_pool.shape[1:] != k_pool.shape[1:]:
        raise ValueError(f"pool shapes {tuple(k_pool.shape)}, {tuple(v_pool.shape)} do not match head_dim {D}")
    H_kv, max_blocks = block_tables.shape[1], block_tables.shape[2]
    if block_tables.shape[0] != B or tuple(lengths.shape) != (B, H_kv) or H_q % H_kv:
        raise ValueError(f"tables {tuple(block_tables.shape)} / lengths {tuple(lengths.shape)} do not fit q "
                         f"{tuple(q.shape)}")
    if codec is not None and (kq_pool is None or vq_pool is None or not codec_readable(codec)):
        raise ValueError("a codec cache needs kq_pool, vq_pool and a codec listing 'triton_attention'")
    group = H_q // H_kv
    max_slots = max_blocks * block_size
    out = torch.zeros((B, H_q, 1, D), dtype=q.dtype, device=q.device)
    key_scores = (torch.zeros((B, H_kv, max_slots), dtype=torch.float32, device=q.device)
                  if return_key_scores else None)
    if out.numel() == 0 or max_slots == 0:
        return out, key_scores
    block_n = block_n or (32 if D > 64 else 64)
    num_splits = int(num_splits or default_num_splits(q.device, B, H_kv, max_slots, block_n))
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(D))
    num_warps = num_warps or (4 if block_d <= 64 else 8)
    precision = "ieee" if q.dtype == torch.float32 else None
    k_args, k_const = _packed_args(codec, "key", block_size, D)
    v_args, v_const = _packed_args(codec, "value", block_size, D)
    kq = kq_pool if codec is not None else k_pool  # dummies for a full-precision cache (never read)
    vq = vq_pool if codec is not None else v_pool
    kqh = kq.view(torch.float16) if codec is not None else k_pool
    vqh = vq.view(torch.float16) if codec is not None else v_pool
    mid_o = torch.empty((B, H_q, num_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, H_q, num_splits), dtype=torch.float32, device=q.device)
    lse = torch.empty((B, H_q), dtype=torch.float32, device=q.device)
    scale_log2 = float(scale) * _LOG2E
    common = dict(H_KV=H_kv, GROUP=group, HEAD_DIM=D, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
                  BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, CODEC=codec is not None,
                  K_BITS=k_const["BITS"], K_SIGNED=k_const["SIGNED"], K_PER_CHANNEL=k_const["PER_CHANNEL"],
                  K_GROUP=k_const["GROUP"], INPUT_PRECISION=precision)
    grid = (B * H_kv, num_splits)
    _decode_stage1[grid](
        q, k_pool, v_pool, kq, vq, kqh, vqh, block_tables, lengths, mid_o, mid_lse,
        scale_log2, max_slots, num_fp,
        q.stride(0), q.stride(1), q.stride(3),
        *k_pool.stride(), *v_pool.stride(),
        *block_tables.stride(), *lengths.stride(),
        *k_args, *v_args,
        V_BITS=v_const["BITS"], V_SIGNED=v_const["SIGNED"], V_PER_CHANNEL=v_const["PER_CHANNEL"],
        V_GROUP=v_const["GROUP"], num_warps=num_warps, **common,
    )
    _decode_stage2[(B * H_q,)](
        mid_o, mid_lse, out, lse, out.stride(0), out.stride(1), out.stride(3),
        H_Q=H_q, HEAD_DIM=D, NUM_SPLITS=num_splits, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=block_d, num_warps=4,
    )
    if key_scores is not None:
        _decode_scores[grid](
            q, k_pool, kq, kqh, block_tables, lengths, lse, key_scores,
            scale_log2, max_slots, num_fp,
            q.stride(0), q.stride(1), q.stride(3), *k_pool.stride(),
            *block_tables.stride(), *lengths.stride(), *key_scores.stride(),
            *k_args, num_warps=num_warps, **common,
        )
    return out, key_scores


__all__ = ["paged_decode_triton", "default_num_splits", "codec_readable"]
