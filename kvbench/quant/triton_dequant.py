"""Triton dequantization of KIVI-packed blocks (2 or 4 bits), checked against `KiviCodec.decode_*`.

Input: the pool rows of one kind, uint8 [n, nbytes] as laid out by `KiviCodec.layout(kind, B, D)`:
    mn    fp16 [S] at byte 0, scale fp16 [S] after it, codes uint8 [B*D*bits/8] after that,
    with S = (B / G) * D for per-channel keys (stat (t // G, d)) or B * ceil(D / G) for per-token groups
    (stat (t, d // G)); element (t, d) is code number t * D + d of the little-endian bit stream.
Output: fp32 [n, B, D] = mn + code * scale. One program per block.

triton is imported lazily: importing this module without triton works, calling the kernel raises ImportError.
On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing this module (the tests do).
"""
from __future__ import annotations

import torch

try:  # triton is an optional dependency
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR: ImportError | None = None
except ImportError as _err:  # pragma: no cover
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = _err


if triton is not None:

    @triton.jit
    def _kivi_dequant_kernel(
        BYTES, HALVES, OUT,
        row_bytes,  # bytes per packed block (even)
        mn_off, scale_off,  # fp16 element offsets inside a row
        codes_off,  # byte offset of the codes inside a row
        n_groups_d,  # ceil(D / G) (per-token groups)
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
        PER_CHANNEL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        t = tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (t < BLOCK_SIZE) & (d < HEAD_DIM)
        e = t * HEAD_DIM + d  # code number inside the block
        byte = tl.load(BYTES + row * row_bytes + codes_off + (e * BITS) // 8, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((e * BITS) % 8)) & ((1 << BITS) - 1)
        if PER_CHANNEL:
            stat = (t // GROUP) * HEAD_DIM + d
        else:
            stat = t * n_groups_d + d // GROUP
        half_row = row * (row_bytes // 2)
        mn = tl.load(HALVES + half_row + mn_off + stat, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(HALVES + half_row + scale_off + stat, mask=mask, other=0.0).to(tl.float32)
        out = mn + code.to(tl.float32) * scale
        tl.store(OUT + row * (BLOCK_SIZE * HEAD_DIM) + e, out, mask=mask)


def kivi_dequantize(codec, blocks: torch.Tensor, kind: str, block_size: int, head_dim: int) -> torch.Tensor:
    """Dequantize KIVI blocks with Triton. blocks: uint8 [n, nbytes] -> fp32 [n, block_size, head_dim]."""
    if triton is None:
        raise ImportError("kivi_dequantize needs triton") from _TRITON_IMPORT_ERROR
    if codec.name != "kivi" or codec.bits not in (2, 4):
        raise ValueError(f"only 2- and 4-bit KIVI blocks, got {codec.name} {codec.bits}")
    lay = codec.layout(kind, block_size, head_dim)
    f = lay.fields
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == lay.nbytes
    assert blocks.is_contiguous(), "pass contiguous rows (gather the pool rows first)"
    assert lay.nbytes % 2 == 0 and f["mn"].offset % 2 == 0 and f["scale"].offset % 2 == 0
    assert f["mn"].dtype == f["scale"].dtype == torch.float16
    n = blocks.shape[0]
    out = torch.empty(n, block_size, head_dim, dtype=torch.float32, device=blocks.device)
    if n == 0:
        return out
    per_channel = kind == "key" and codec.key_axis == "channel"
    _kivi_dequant_kernel[(n,)](
        blocks, blocks.view(torch.float16), out,
        lay.nbytes, f["mn"].offset // 2, f["scale"].offset // 2, f["codes"].offset,
        -(-head_dim // codec.group_size),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BITS=codec.bits, GROUP=codec.group_size,
        PER_CHANNEL=per_channel, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
