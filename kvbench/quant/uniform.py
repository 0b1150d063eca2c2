"""Uniform quantizers: asymmetric group-wise (KIVI), symmetric int8 per token, fp8 e4m3 per token.

All metadata (scales, minimums) is stored in fp16 and rounded in the safe direction (minimum down, scale up),
so the stored range always covers the group and the round-trip error is at most scale / 2 per element
(plus float rounding), the scale being the fp16 value that is stored.
"""
from __future__ import annotations

import torch

FP16_MAX = 65504.0
_FP16_TINY = 2.0**-24  # smallest fp16 subnormal; scales are kept at least this large


def fp16_round_down(x: torch.Tensor) -> torch.Tensor:
    """The largest fp16 <= x (x finite, inside the fp16 range), as fp16."""
    h = x.to(torch.float16)
    return torch.where(h.float() > x.float(), torch.nextafter(h, torch.full_like(h, -float("inf"))), h)


def fp16_round_up(x: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 >= x (x finite, inside the fp16 range), as fp16."""
    h = x.to(torch.float16)
    return torch.where(h.float() < x.float(), torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _grouped(x: torch.Tensor, dim: int, group_size: int) -> torch.Tensor:
    """Move `dim` last and split it into groups: x [..., n, ...] -> [..., ceil(n/g), g].

    A last partial group is padded by repeating its last element (which leaves its min and max unchanged).
    """
    xt = x.movedim(dim, -1)
    n = xt.shape[-1]
    pad = -n % group_size
    if pad:
        idx = torch.arange(n + pad, device=x.device).clamp_(max=n - 1)
        xt = xt.index_select(-1, idx)
    return xt.unflatten(-1, (-1, group_size))


def _ungrouped(xg: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """Inverse of `_grouped`: [..., ngroups, g] -> x with `dim` of size n restored."""
    return xg.flatten(-2)[..., :n].movedim(-1, dim)


def quantize_asym(x: torch.Tensor, bits: int, dim: int, group_size: int):
    """Asymmetric uniform quantization in groups of `group_size` consecutive elements along `dim`.

    Each group shares a minimum `mn` and a `scale`; x ~= mn + code * scale, code in [0, 2**bits).
    x: [..., n, ...] float -> (codes uint8 like x, mn fp16, scale fp16), where mn and scale have x's shape
    with `dim` replaced by ceil(n / group_size). KIVI keys per channel: tile [blocks, T, D], dim=1 (groups of
    G tokens share a scale per channel); KIVI values per token: dim=2 (groups of G channels of one token).
    """
    dim = dim % x.dim()
    n = x.shape[dim]
    xg = _grouped(x.float(), dim, group_size)  # [..., ngroups, g]
    levels = (1 << bits) - 1
    mn = fp16_round_down(xg.amin(-1).clamp(-FP16_MAX, FP16_MAX))  # [..., ngroups]
    span = (xg.amax(-1) - mn.float()) / levels
    scale = fp16_round_up(span.clamp(_FP16_TINY, FP16_MAX))
    codes = torch.round((xg - mn.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, levels)
    codes = _ungrouped(codes.to(torch.uint8), dim, n)
    return codes, mn.movedim(-1, dim), scale.movedim(-1, dim)


def dequantize_asym(codes: torch.Tensor, mn: torch.Tensor, scale: torch.Tensor, dim: int, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_asym`: mn + code * scale, with each group's mn and scale broadcast along `dim`."""
    dim = dim % codes.dim()
    n = codes.shape[dim]
    if n % group_size == 0:  # broadcast each group's stats over its members: no expanded copies
        c = codes.unflatten(dim, (-1, group_size)).float()  # [..., ngroups, g, ...]
        out = torch.addcmul(mn.float().unsqueeze(dim + 1), c, scale.float().unsqueeze(dim + 1))
        return out.flatten(dim, dim + 1).to(dtype)
    mn_e = mn.float().repeat_interleave(group_size, dim=dim).narrow(dim, 0, n)
    scale_e = scale.float().repeat_interleave(group_size, dim=dim).narrow(dim, 0, n)
    return torch.addcmul(mn_e, codes.float(), scale_e).to(dtype)


def quantize_int8_sym(x: torch.Tensor, dim: int = -1):
    """Symmetric int8 along `dim` (per token for dim=-1 of [..., D]): x ~= code * scale, code in [-127, 127].

    Symmetric (no zero point) because per-token K/V are roughly centred and it keeps the decode one multiply.
    x: [..., D] -> (codes int8 [..., D], scale fp16 [..., 1]) for dim=-1.
    """
    xf = x.float()
    amax = xf.abs().amax(dim, keepdim=True)
    scale = fp16_round_up((amax / 127).clamp(_FP16_TINY, FP16_MAX))
    codes = torch.round(xf / scale.float()).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8_sym(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of `quantize_int8_sym`."""
    return (codes.float() * scale.float()).to(dtype)


FP8_E4M3_MAX = 448.0


def quantize_fp8(x: torch.Tensor, dim: int = -1):
    """fp8 e4m3 (torch.float8_e4m3fn) along `dim` with one fp16 scale per vector: x ~= fp8(x / scale) * scale.

    scale = amax / 448, rounded up, so x / scale stays inside the e4m3 range (round to nearest even on cast).
    x: [..., D] -> (codes float8_e4m3fn [..., D], scale fp16 [..., 1]) for dim=-1.
    """
    xf = x.float()
    amax = xf.abs().amax(dim, keepdim=True)
    scale = fp16_round_up((amax / FP8_E4M3_MAX).clamp(_FP16_TINY, FP16_MAX))
    codes = (xf / scale.float()).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
    """Inverse of `quantize_fp8`. codes: float8_e4m3fn, or its raw bytes as uint8 (decoded by table lookup,
    several times faster than the fp8 -> fp32 cast on CPU)."""
    if codes.dtype == torch.uint8:
        lut = torch.arange(256, dtype=torch.uint8, device=codes.device).view(torch.float8_e4m3fn).float()
        values = lut.index_select(0, codes.reshape(-1).long()).view(codes.shape)
    else:
        values = codes.float()
    return (values * scale.float()).to(dtype)
