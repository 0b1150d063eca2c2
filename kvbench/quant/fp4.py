"""FP4 (E2M1) block quantization: NVIDIA's NVFP4 and the OCP Microscaling MXFP4, as pure tensor functions.

E2M1 (1 sign, 2 exponent, 1 mantissa bit, no inf / NaN) holds the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; its
4-bit code is sign << 3 | magnitude index, the index being the E2M1 bit pattern itself (exponent << 1 | mantissa).
Rounding is to nearest, ties to the even code (mantissa 0), and magnitudes past 6 saturate to 6 (as the MX spec's
conversion and NVIDIA's cvt.rn.satfinite do).

    NVFP4: groups of 16 consecutive values share an FP8 E4M3 scale, the whole tensor one FP32 scale:
           x ~= e2m1 * e4m3_scale * tensor_scale, tensor_scale = tensor_amax / (448 * 6),
           e4m3_scale = e4m3(group_amax / 6 / tensor_scale) (so the largest group's scale is 448).
    MXFP4: groups of 32 share an E8M0 scale (a power of two, the byte being the biased exponent):
           X = 2 ** (floor(log2(group_amax)) - 2) (2: E2M1's largest exponent, OCP MX spec v1.0 section 6.3),
           x ~= e2m1(x / X) * X, values past 6 * X saturated.

Groups run along the last dim; a last partial group is padded with zeros (which change no amax).
"""
from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_EMAX = 2  # E2M1's largest exponent (6 = 1.5 * 2**2)
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-9  # the smallest E4M3 subnormal: scales are kept at least this large (no zero scale)
E8M0_BIAS = 127
NVFP4_GROUP = 16
MXFP4_GROUP = 32

# the magnitude of each 3-bit E2M1 pattern, and the midpoints between neighbours (rounding boundaries)
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_values(device=None) -> torch.Tensor:
    """The 16 E2M1 values by code (codes 8..15: the negatives; code 8 is -0, decoded as 0): float32 [16]."""
    mags = torch.tensor(_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags]) + 0.0  # -0.0 + 0.0 = +0.0


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float [...] -> uint8 codes [...] in 0..15: nearest E2M1 value, ties to the even code, |x| > 6 saturated."""
    xf = x.float()
    mag = xf.abs().clamp_(max=E2M1_MAX)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(mag, mids)  # mag == a midpoint -> the lower neighbour's index
    tie = (idx < len(_MIDPOINTS)) & (mag == mids[idx.clamp(max=len(_MIDPOINTS) - 1)])
    idx = idx + (tie & (idx % 2 == 1)).long()  # a tie rounds to the even index (mantissa 0)
    sign = (xf < 0) & (idx > 0)  # a value that rounds to zero is stored as +0
    return (idx | (sign.long() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [...] -> float32 [...] (table lookup)."""
    return e2m1_values(codes.device).index_select(0, codes.reshape(-1).long()).view(codes.shape)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., n] -> [..., ceil(n / group), group], a last partial group padded with zeros."""
    pad = -x.shape[-1] % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, group))


def _ungroup(xg: torch.Tensor, n: int) -> torch.Tensor:
    return xg.flatten(-2)[..., :n]


def e4m3_bits_decode(raw: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 (float8_e4m3fn) bit patterns -> float32 (table lookup)."""
    lut = torch.arange(256, dtype=torch.uint8, device=raw.device).view(torch.float8_e4m3fn).float()
    return lut.index_select(0, raw.reshape(-1).long()).view(raw.shape)


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """The FP32 per-tensor scale of an NVFP4 tensor of absolute maximum `amax`: amax / (448 * 6), never zero."""
    return (amax.float() / (E4M3_MAX * E2M1_MAX)).clamp(min=torch.finfo(torch.float32).tiny)


def nvfp4_quantize(x: torch.Tensor, tensor_scale: torch.Tensor):
    """NVFP4 along the last dim of x [..., n] with the FP32 `tensor_scale` (broadcastable to x[..., :1]).

    Returns (codes uint8 [..., n] in 0..15, group scales as E4M3 bytes uint8 [..., ceil(n / 16)]).
    """
    n = x.shape[-1]
    xg = _groups(x.float(), NVFP4_GROUP)  # [..., ng, 16]
    ts = tensor_scale.float().unsqueeze(-1)  # [..., 1, 1]
    group_scale = xg.abs().amax(-1, keepdim=True) / E2M1_MAX / ts  # [..., ng, 1], in E4M3's range
    scale8 = group_scale.clamp(E4M3_TINY, E4M3_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_encode(xg / (scale8.float() * ts))
    return _ungroup(codes, n), scale8.squeeze(-1).view(torch.uint8)


def nvfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `nvfp4_quantize`: codes [..., n], E4M3 bytes [..., ng], tensor_scale -> float32 [..., n]."""
    n = codes.shape[-1]
    vals = _groups(e2m1_decode(codes), NVFP4_GROUP)  # [..., ng, 16]
    step = e4m3_bits_decode(scales) * tensor_scale.float()  # [..., ng]
    return _ungroup(vals * step.unsqueeze(-1), n)


def mxfp4_quantize(x: torch.Tensor):
    """MXFP4 along the last dim of x [..., n]: (codes uint8 [..., n], E8M0 bytes uint8 [..., ceil(n / 32)]).

    The shared exponent is floor(log2(group amax)) - 2, clamped to E8M0's [-127, 127]; an all-zero group takes
    the smallest exponent (its codes are zeros). No byte 255 (E8M0's NaN) is ever written.
    """
    n = x.shape[-1]
    xg = _groups(x.float(), MXFP4_GROUP)  # [..., ng, 32]
    amax = xg.abs().amax(-1, keepdim=True)  # [..., ng, 1]
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.full_like(amax, -E8M0_BIAS))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(xg * torch.exp2(-exp))  # x / 2**exp, exact in float32
    return _ungroup(codes, n), (exp.squeeze(-1) + E8M0_BIAS).to(torch.uint8)


def mxfp4_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Inverse of `mxfp4_quantize`: codes [..., n], E8M0 bytes [..., ng] -> float32 [..., n]."""
    n = codes.shape[-1]
    vals = _groups(e2m1_decode(codes), MXFP4_GROUP)  # [..., ng, 32]
    step = torch.exp2(scales.float() - E8M0_BIAS)  # [..., ng]
    return _ungroup(vals * step.unsqueeze(-1), n)
