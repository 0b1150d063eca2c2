"""Triton dequantization of packed blocks: unsigned uniform codes (KIVI 2 / 4 bits) and FP4 (NVFP4, MXFP4),
checked against the codec's own `decode_keys` / `decode_values` (tests/quant/test_codecs.py,
tests/quant/test_fp4.py).

Input: the pool rows of one kind, uint8 [n, nbytes], of a codec that lists "triton_dequant" in its `kernels`.
- Uniform codes, as the codec's `affine_rows(kind, B, D)` describes them: element (t, d) is code number t * D + d
  of the little-endian bit stream; mn and scale are fp16, one per group: (t // G, d) per channel, (t, d // G) per
  token. Output: fp32 [n, B, D] = mn + code * scale.
- FP4, as the codec's `fp4_rows(kind, B, D)` describes them: 4-bit E2M1 codes, one scale byte per (t, d // G)
  (E4M3 bits or an E8M0 exponent), an optional fp32 tensor scale. Output: e2m1(code) * scale [* tensor scale].
A codec wrapped in a rotation (kvbench.quant.rotation: `inner`, `unrotate`) is read as its inner codec's rows,
then rotated back. One program per block.

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
    def _dequant_kernel(
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


    @triton.jit
    def _fp4_dequant_kernel(
        BYTES, OUT,
        row_bytes, codes_off, scale_off,  # byte offsets inside a row
        tscale_off,  # byte offset of the fp32 tensor scale (unused without HAS_TSCALE)
        n_groups_d,  # ceil(D / G)
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, E8M0: tl.constexpr,
        HAS_TSCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = BYTES + row * row_bytes
        t = tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
        d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
        mask = (t < BLOCK_SIZE) & (d < HEAD_DIM)
        e = t * HEAD_DIM + d  # code number inside the block
        byte = tl.load(base + codes_off + e // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((e % 2) * 4)) & 15
        # E2M1: sign << 3 | exponent << 1 | mantissa; exponent 0 is the subnormal 0 / 0.5
        ex = (code >> 1) & 3
        man = (code & 1).to(tl.float32)
        mag = tl.where(ex == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((ex - 1).to(tl.float32)))
        val = tl.where((code & 8) != 0, -mag, mag)
        sb = tl.load(base + scale_off + t * n_groups_d + d // GROUP, mask=mask, other=0).to(tl.int32)
        if E8M0:  # a biased power-of-two exponent
            scale = tl.exp2((sb - 127).to(tl.float32))
        else:  # E4M3 bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal
            se = (sb >> 3) & 15
            sm = (sb & 7).to(tl.float32)
            smag = tl.where(se == 0, sm * 0.001953125, (1.0 + sm * 0.125) * tl.exp2((se - 7).to(tl.float32)))
            scale = tl.where((sb & 128) != 0, -smag, smag)
        if HAS_TSCALE:  # (scale * tensor scale) first: the torch decode's order, so both round alike
            scale = scale * tl.load((base + tscale_off).to(tl.pointer_type(tl.float32)))
        out = val * scale
        tl.store(OUT + row * (BLOCK_SIZE * HEAD_DIM) + e, out, mask=mask)


def dequantize_rows(codec, blocks: torch.Tensor, kind: str, block_size: int, head_dim: int) -> torch.Tensor:
    """Dequantize a codec's packed rows with Triton. blocks: uint8 [n, nbytes] -> fp32 [n, block_size, head_dim]."""
    if triton is None:
        raise ImportError("dequantize_rows needs triton") from _TRITON_IMPORT_ERROR
    if "triton_dequant" not in getattr(codec, "kernels", ()):
        raise ValueError(f"the Triton dequantizer cannot read {getattr(codec, 'name', codec)!r} blocks "
                         "(2- and 4-bit KIVI, NVFP4 and MXFP4 only)")
    inner = getattr(codec, "inner", codec)  # a rotated codec: its inner codec's rows, rotated back after
    if hasattr(inner, "fp4_rows"):
        out = _dequantize_fp4(inner, blocks, kind, block_size, head_dim)
    else:
        out = _dequantize_affine(inner, blocks, kind, block_size, head_dim)
    return codec.unrotate(out, kind) if inner is not codec else out


def _dequantize_fp4(codec, blocks: torch.Tensor, kind: str, block_size: int, head_dim: int) -> torch.Tensor:
    rows = codec.fp4_rows(kind, block_size, head_dim)
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == rows.row_bytes
    assert blocks.is_contiguous(), "pass contiguous rows (gather the pool rows first)"
    assert rows.tensor_scale_offset < 0 or (rows.row_bytes % 4 == 0 and rows.tensor_scale_offset % 4 == 0)
    n = blocks.shape[0]
    out = torch.empty(n, block_size, head_dim, dtype=torch.float32, device=blocks.device)
    if n == 0:
        return out
    _fp4_dequant_kernel[(n,)](
        blocks, out, rows.row_bytes, rows.codes_offset, rows.scale_offset, max(rows.tensor_scale_offset, 0),
        -(-head_dim // rows.group),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=rows.group, E8M0=rows.scale_format == "e8m0",
        HAS_TSCALE=rows.tensor_scale_offset >= 0, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def _dequantize_affine(codec, blocks: torch.Tensor, kind: str, block_size: int, head_dim: int) -> torch.Tensor:
    rows = codec.affine_rows(kind, block_size, head_dim)
    assert not rows.signed and rows.mn_offset >= 0, "unsigned codes with a minimum"
    assert blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == rows.row_bytes
    assert blocks.is_contiguous(), "pass contiguous rows (gather the pool rows first)"
    assert rows.row_bytes % 2 == 0 and rows.mn_offset % 2 == 0 and rows.scale_offset % 2 == 0
    n = blocks.shape[0]
    out = torch.empty(n, block_size, head_dim, dtype=torch.float32, device=blocks.device)
    if n == 0:
        return out
    _dequant_kernel[(n,)](
        blocks, blocks.view(torch.float16), out,
        rows.row_bytes, rows.mn_offset // 2, rows.scale_offset // 2, rows.codes_offset,
        -(-head_dim // rows.group),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BITS=rows.bits, GROUP=rows.group,
        PER_CHANNEL=rows.per_channel, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
