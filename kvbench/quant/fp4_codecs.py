"""The FP4 storage codecs: NVFP4 and MXFP4 blocks of K and V (kvbench.quant.fp4 holds the formats' arithmetic).

Both quantize every token's head_dim values in groups along the head dim (16 for NVFP4, 32 for MXFP4), keys and
values alike, as vLLM's FP4 KV caches do; codes are packed two a byte (code 2j in the low nibble of byte j, as
kvbench.quant.packing's 4-bit streams). No full-precision window: a block is packed once it is full.

NVFP4's per-tensor FP32 scale in a streaming cache: the tensor is never whole, so serving engines take it from
calibration (ModelOpt / TensorRT-LLM's calibrated k/v amax, which vLLM loads from the checkpoint as k_scale /
v_scale, 1.0 when absent). Here, with `tensor_amax=None` (the default) each packed block, one (layer, kv-head) tile
of block_size tokens, is the tensor: its amax sets the FP32 scale, stored in the row (4 bytes), so rows stay
self-contained and independent of the order sequences arrive in; a number fixes the amax for every block, as a
calibrated checkpoint scale does (values past it saturate).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvbench.quant.codecs import KVCodec
from kvbench.quant.fp4 import (MXFP4_GROUP, NVFP4_GROUP, mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize,
                               nvfp4_quantize, nvfp4_tensor_scale)
from kvbench.quant.packing import pack_codes, packed_nbytes, unpack_codes


@dataclass(frozen=True)
class Fp4Rows:
    """How a kernel reads a packed FP4 row: element (t, d) of the [block_size, head_dim] tile is
    e2m1(code) * scale(t, d // group) [* tensor_scale].

    Codes: 4 bits each, element t * head_dim + d, low nibble first, from byte `codes_offset`; scales: one byte per
    (t, d // group), row-major over [block_size, ceil(head_dim / group)], from byte `scale_offset`, E4M3 bits
    (scale_format "e4m3") or a biased power-of-two exponent ("e8m0"); tensor_scale: one float32 at byte
    `tensor_scale_offset` (-1: none)."""

    row_bytes: int
    codes_offset: int
    scale_offset: int
    tensor_scale_offset: int
    group: int
    scale_format: str


class _Fp4Codec(KVCodec):
    """Shared layout of the FP4 codecs: packed E2M1 codes and one scale byte per group of each token."""

    layer_independent = True
    bits = 4
    group = NVFP4_GROUP
    scale_format = "e4m3"
    kernels = frozenset({"cpu_attention", "triton_dequant"})  # the C codec kernels and the Triton dequantizer

    def _n_groups(self, head_dim: int) -> int:
        return -(-head_dim // self.group)

    def _base_fields(self, block_size: int, head_dim: int) -> list[tuple[str, torch.dtype, int]]:
        return [("codes", torch.uint8, packed_nbytes(block_size * head_dim, 4)),
                ("scales", torch.uint8, block_size * self._n_groups(head_dim))]

    def fp4_rows(self, kind, block_size: int, head_dim: int) -> Fp4Rows:
        """How the Triton dequantizer reads a packed `kind` row."""
        lay = self.layout(kind, block_size, head_dim)
        f = lay.fields
        ts = f["tensor_scale"].offset if "tensor_scale" in f else -1
        return Fp4Rows(lay.nbytes, f["codes"].offset, f["scales"].offset, ts, self.group, self.scale_format)

    def _codes(self, f, block_size: int, head_dim: int) -> torch.Tensor:
        n = f["codes"].shape[0]
        return unpack_codes(f["codes"], 4, block_size * head_dim).view(n, block_size, head_dim)


@dataclass(eq=False)
class Nvfp4Codec(_Fp4Codec):
    """NVFP4: E2M1 codes, an E4M3 scale per 16 values of a token, an FP32 scale per block (or a fixed amax)."""

    tensor_amax: float | None = None
    name: str = field(default="nvfp4", init=False)

    def __post_init__(self):
        amax = self.tensor_amax
        if amax is not None and not 0 < float(amax) < float("inf"):
            raise ValueError(f"tensor_amax must be a positive number or null, got {self.tensor_amax!r}")

    def _fields(self, kind, block_size, head_dim):
        return [("tensor_scale", torch.float32, 1)] + self._base_fields(block_size, head_dim)

    def _encode(self, tile, kind, layer, head):
        n = tile.shape[0]  # tile [n, B, D]
        amax = tile.detach().float().abs().amax((1, 2)) if self.tensor_amax is None else \
            torch.full((n,), float(self.tensor_amax), device=tile.device)
        ts = nvfp4_tensor_scale(amax)  # [n]
        codes, scales = nvfp4_quantize(tile, ts.view(n, 1, 1))  # [n, B, D], [n, B, ceil(D / 16)]
        return {"codes": pack_codes(codes.reshape(n, -1), 4), "scales": scales, "tensor_scale": ts}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        scales = f["scales"].reshape(n, block_size, -1)
        return nvfp4_dequantize(self._codes(f, block_size, head_dim), scales, f["tensor_scale"].view(n, 1, 1))


@dataclass(eq=False)
class Mxfp4Codec(_Fp4Codec):
    """MXFP4 (OCP Microscaling): E2M1 codes and an E8M0 power-of-two scale per 32 values of a token."""

    group = MXFP4_GROUP
    scale_format = "e8m0"
    name: str = field(default="mxfp4", init=False)

    def _fields(self, kind, block_size, head_dim):
        return self._base_fields(block_size, head_dim)

    def _encode(self, tile, kind, layer, head):
        n = tile.shape[0]
        codes, scales = mxfp4_quantize(tile)  # [n, B, D], [n, B, ceil(D / 32)]
        return {"codes": pack_codes(codes.reshape(n, -1), 4), "scales": scales}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        return mxfp4_dequantize(self._codes(f, block_size, head_dim), f["scales"].reshape(n, block_size, -1))
