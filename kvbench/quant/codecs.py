"""Storage codecs: the byte layout of a packed KV block, and its encode / decode.

A packed block holds `block_size` tokens of one (sequence, layer, kv-head): a K tile or a V tile
[block_size, head_dim]. Encode / decode work on a batch of blocks:

    encode_keys(tile [n, B, D] float, layer=0, head=0) -> uint8 [n, packed_block_bytes(B, D, "key")]
    decode_keys(blocks uint8 [n, nbytes], B, D, layer=0, head=0, dtype=float32) -> [n, B, D]

(the same for values). `head` is an int or a LongTensor [n] (one kv-head per block); only codecs with per-head
calibration (KVQuant keys with calibrated ranges) read it, and `layer` selects per-layer level sets.
Every byte a block needs (codes, scales, zero points, outliers, alignment padding) is inside the row, so the
pool's byte count is the real footprint; `bits_per_element` is computed from that count.

Tokens the codec keeps in full precision (KIVI's newest `residual` tokens, KVQuant's first token) are the pool's
business: `packed_block_range(num_tokens, block_size)` says which blocks of a table are stored packed and
`fp_block_dtype` is the dtype the codec's full-precision blocks are meant to use (fp16, as in the papers).

Kernels: a codec lists in `kernels` the runtime kernels that may read its packed rows in place, through the
`affine_rows` description, instead of calling decode_keys / decode_values; the runtime never matches codecs by name.
    "cpu_attention"   the C attention over a codec cache (kvbench/runtime/backends/cpu: decode and prefill)
    "triton_dequant"  the Triton dequantizer (kvbench/runtime/backends/triton/dequant.py: unsigned codes, with mn)
    "triton_attention" the Triton split-KV decode (kvbench/runtime/backends/triton/decode.py: any `affine_rows`)
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields as dc_fields
from typing import Literal

import torch

from kvbench.quant.nonuniform import NuqTensor, nuq_dequantize, nuq_quantize, outlier_count, uniform_levels
from kvbench.quant.packing import ByteLayout, index_bits, pack_codes, packed_nbytes, unpack_codes
from kvbench.quant.uniform import (dequantize_asym, dequantize_fp8, dequantize_int8_sym, quantize_asym,
                                   quantize_fp8, quantize_int8_sym)

Kind = Literal["key", "value"]


@dataclass(frozen=True)
class AffineRows:
    """How a kernel reads a packed K or V row of uniform codes: element (t, d) of the [block_size, head_dim] tile is
    mn + code * scale (unsigned codes) or code * scale (signed codes, no mn: mn_offset -1).

    The codes are a little-endian stream of `bits`-bit codes, element t * head_dim + d, from byte `codes_offset`;
    mn and scale are fp16 arrays from byte `mn_offset` / `scale_offset`, indexed by the element's group:
    (t // group, d) with `per_channel` (row-major over [block_size / group, head_dim]), else (t, d // group)
    (row-major over [block_size, ceil(head_dim / group)])."""

    row_bytes: int
    codes_offset: int
    mn_offset: int
    scale_offset: int
    bits: int
    signed: bool
    per_channel: bool
    group: int


class KVCodec:
    """Base class of the storage codecs. Subclasses define `_fields`, `_encode` and `_decode` for one kind."""

    name: str = "codec"
    bits: int = 16  # nominal bits per code
    block_size_hint: int = 16  # tokens per packed block the codec is designed for
    residual: int = 0  # newest tokens of a table kept in full precision
    first_token_fp: bool = False  # the block holding token 0 stays in full precision
    fp_block_dtype: torch.dtype | None = None  # dtype meant for the full-precision blocks (None: the model's)
    pre_rope_keys: bool = False  # keys are stored (and quantized) before RoPE, rotated after decoding
    layer_independent: bool = False  # encoding ignores layer and head (blocks of all layers encode in one call)
    kernels: frozenset[str] = frozenset()  # runtime kernels that read the packed rows in place (module docstring)

    # ---- subclass hooks
    def _fields(self, kind: Kind, block_size: int, head_dim: int) -> list[tuple[str, torch.dtype, int]]:
        raise NotImplementedError

    def _encode(self, tile: torch.Tensor, kind: Kind, layer: int, head) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, f: dict[str, torch.Tensor], kind: Kind, block_size: int, head_dim: int, layer: int,
                head) -> torch.Tensor:
        raise NotImplementedError

    # ---- public interface
    def layout(self, kind: Kind, block_size: int, head_dim: int) -> ByteLayout:
        """The byte layout of one packed K or V block (cached per geometry)."""
        cache = self.__dict__.setdefault("_layouts", {})
        key = (kind, block_size, head_dim)
        if key not in cache:
            self._check_geometry(kind, block_size, head_dim)
            cache[key] = ByteLayout(self._fields(kind, block_size, head_dim))
        return cache[key]

    def packed_block_bytes(self, block_size: int, head_dim: int, kind: Kind) -> int:
        """Bytes of one packed block of `block_size` tokens x `head_dim`, all metadata included."""
        return self.layout(kind, block_size, head_dim).nbytes

    def bits_per_element(self, block_size: int, head_dim: int, kind: Kind | None = None) -> float:
        """8 * packed bytes / elements; kind=None: the mean over K and V (same element count)."""
        kinds = ("key", "value") if kind is None else (kind,)
        nbytes = sum(self.packed_block_bytes(block_size, head_dim, k) for k in kinds) / len(kinds)
        return 8.0 * nbytes / (block_size * head_dim)

    def encode_keys(self, tile: torch.Tensor, layer: int = 0, head=0) -> torch.Tensor:
        """tile [n, B, D] float -> uint8 [n, packed_block_bytes(B, D, "key")]."""
        return self._encode_kind(tile, "key", layer, head)

    def encode_values(self, tile: torch.Tensor, layer: int = 0, head=0) -> torch.Tensor:
        """tile [n, B, D] float -> uint8 [n, packed_block_bytes(B, D, "value")]."""
        return self._encode_kind(tile, "value", layer, head)

    def decode_keys(self, blocks: torch.Tensor, block_size: int, head_dim: int, layer: int = 0, head=0,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [n, nbytes] -> [n, block_size, head_dim] of `dtype`."""
        return self._decode_kind(blocks, "key", block_size, head_dim, layer, head, dtype)

    def decode_values(self, blocks: torch.Tensor, block_size: int, head_dim: int, layer: int = 0, head=0,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """uint8 [n, nbytes] -> [n, block_size, head_dim] of `dtype`."""
        return self._decode_kind(blocks, "value", block_size, head_dim, layer, head, dtype)

    def affine_rows(self, kind: Kind, block_size: int, head_dim: int) -> AffineRows | None:
        """How the kernels in `kernels` read a packed `kind` row; None for a codec that lists none."""
        return None

    def packed_block_range(self, num_tokens: int, block_size: int) -> range:
        """Indices of the blocks of a (layer, head) table of `num_tokens` tokens that are stored packed.

        Full blocks whose tokens are all older than the newest `residual` tokens, skipping block 0 when
        `first_token_fp`; the rest stay in full precision (at most residual + block_size - 1 recent tokens).
        """
        start = 1 if self.first_token_fp else 0
        stop = max(0, num_tokens - self.residual) // block_size
        return range(start, max(start, stop))

    def describe(self) -> dict:
        """Flat dict of the codec's settings, for results records."""
        out = {"codec": self.name, "bits": self.bits}
        for f in dc_fields(self) if hasattr(self, "__dataclass_fields__") else ():
            v = getattr(self, f.name)
            if f.name in ("name", "layer_independent") or isinstance(v, torch.Tensor):
                continue
            if isinstance(v, (int, float, str, bool)) or v is None:
                out[f.name] = v
            elif isinstance(v, torch.dtype):
                out[f.name] = str(v).removeprefix("torch.")
        return out

    # ---- plumbing
    def _check_geometry(self, kind: Kind, block_size: int, head_dim: int) -> None:
        if kind not in ("key", "value"):
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if block_size < 1 or head_dim < 1:
            raise ValueError(f"bad block geometry {block_size} x {head_dim}")

    def _encode_kind(self, tile: torch.Tensor, kind: Kind, layer: int, head) -> torch.Tensor:
        if tile.dim() != 3:
            raise ValueError(f"expected a tile [n_blocks, block_size, head_dim], got {tuple(tile.shape)}")
        lay = self.layout(kind, tile.shape[1], tile.shape[2])
        return lay.pack(**self._encode(tile, kind, layer, head))

    def _decode_kind(self, blocks, kind, block_size, head_dim, layer, head, dtype) -> torch.Tensor:
        f = self.layout(kind, block_size, head_dim).unpack(blocks)
        return self._decode(f, kind, block_size, head_dim, layer, head).to(dtype)


@dataclass(eq=False)
class FullPrecisionCodec(KVCodec):
    """No compression: the tile's elements in `dtype` (fp16 by default; pass the model's dtype for exactness)."""

    layer_independent: bool = field(default=True, init=False)

    dtype: torch.dtype = torch.float16
    name: str = field(default="full", init=False)

    def __post_init__(self):
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {self.dtype}")
        self.bits = torch.finfo(self.dtype).bits

    def _fields(self, kind, block_size, head_dim):
        return [("x", self.dtype, block_size * head_dim)]

    def _encode(self, tile, kind, layer, head):
        return {"x": tile.reshape(tile.shape[0], -1)}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        return f["x"].reshape(-1, block_size, head_dim)

    def packed_block_range(self, num_tokens: int, block_size: int) -> range:
        return range(num_tokens // block_size)


@dataclass(eq=False)
class KiviCodec(KVCodec):
    """KIVI: asymmetric uniform quantization, fp16 minimum + fp16 scale per group.

    Keys per channel (each group of `group_size` tokens shares one minimum and scale per channel; a packed
    block of `group_size` tokens is exactly one key group), or per token for key_axis="token" (the ablation);
    values per token over groups of `group_size` channels. The newest `residual` tokens stay in full precision.
    Values are quantized a block at a time, not token by token as in the paper; per-token quantization gives
    the same numbers, only the full-precision window varies between residual and residual + block - 1.
    """

    layer_independent: bool = field(default=True, init=False)

    bits: int = 2
    group_size: int = 32
    residual: int = 128
    key_axis: Literal["channel", "token"] = "channel"
    name: str = field(default="kivi", init=False)
    fp_block_dtype: torch.dtype = field(default=torch.float16, init=False)

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"kivi bits must be 2, 4 or 8, got {self.bits}")
        if self.group_size < 1 or self.residual < 0 or self.residual % self.group_size:
            raise ValueError(f"need group_size >= 1 and residual % group_size == 0, got "
                             f"G={self.group_size} R={self.residual}")
        if self.key_axis not in ("channel", "token"):
            raise ValueError(f"key_axis must be 'channel' or 'token', got {self.key_axis!r}")
        self.block_size_hint = self.group_size

    def _axis(self, kind: Kind) -> int:
        """Tile axis a group runs along: 1 (tokens: per-channel) or 2 (channels: per-token)."""
        return 1 if kind == "key" and self.key_axis == "channel" else 2

    def _check_geometry(self, kind, block_size, head_dim):
        super()._check_geometry(kind, block_size, head_dim)
        if self._axis(kind) == 1 and block_size % self.group_size:
            raise ValueError(f"per-channel keys need block_size % group_size == 0, got {block_size} % "
                             f"{self.group_size}")

    def _stats_numel(self, kind, block_size, head_dim) -> int:
        if self._axis(kind) == 1:
            return block_size // self.group_size * head_dim
        return block_size * -(-head_dim // self.group_size)

    @property
    def kernels(self) -> frozenset[str]:
        """The C attention and the Triton decode read 2, 4 and 8 bits; the Triton dequantizer 2 and 4."""
        both = {"cpu_attention", "triton_attention"}
        return frozenset(both | {"triton_dequant"} if self.bits in (2, 4) else both)

    def affine_rows(self, kind, block_size, head_dim):
        lay = self.layout(kind, block_size, head_dim)
        f = lay.fields
        return AffineRows(lay.nbytes, f["codes"].offset, f["mn"].offset, f["scale"].offset, self.bits, False,
                          self._axis(kind) == 1, self.group_size)

    def _fields(self, kind, block_size, head_dim):
        s = self._stats_numel(kind, block_size, head_dim)
        return [("codes", torch.uint8, packed_nbytes(block_size * head_dim, self.bits)),
                ("mn", torch.float16, s), ("scale", torch.float16, s)]

    def _encode(self, tile, kind, layer, head):
        n = tile.shape[0]
        codes, mn, scale = quantize_asym(tile, self.bits, self._axis(kind), self.group_size)
        return {"codes": pack_codes(codes.reshape(n, -1), self.bits), "mn": mn, "scale": scale}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        axis = self._axis(kind)
        codes = unpack_codes(f["codes"], self.bits, block_size * head_dim).view(n, block_size, head_dim)
        shape = (n, block_size // self.group_size, head_dim) if axis == 1 else (n, block_size, -1)
        return dequantize_asym(codes, f["mn"].reshape(shape), f["scale"].reshape(shape), axis, self.group_size)


@dataclass(eq=False)
class KVQuantCodec(KVCodec):
    """KVQuant: nuqX levels per layer, dense-and-sparse outliers, keys per channel, values per token.

    key_levels / value_levels: float [n_layers, 2**bits] (or [2**bits] for all layers), sorted in [-1, 1],
    from `fit_nuq_levels`; required for levels="nuq", ignored for levels="uniform" (evenly spaced, the intX
    ablation). key_ranges: optional calibrated per-channel thresholds [n_layers, n_kv_heads, 2, head_dim]
    (`fit_channel_ranges` on pre-RoPE keys): then key blocks store no ranges, as in KVQuant; without them key
    ranges are computed online per block and stored (fp16 lo / hi per channel). Value ranges are always online.
    Outliers: ceil(outlier_fraction * B * D) per block, fp16 (or `outlier_dtype`) values plus bit-packed
    in-block positions. Keys are quantized as given (the caller passes pre-RoPE keys and rotates after decode).
    """

    bits: int = 3
    outlier_fraction: float = 0.01
    levels: Literal["nuq", "uniform"] = "nuq"
    key_levels: torch.Tensor | None = None
    value_levels: torch.Tensor | None = None
    key_ranges: torch.Tensor | None = None
    outlier_dtype: torch.dtype = torch.float16
    first_token_fp: bool = True
    block_size_hint: int = 32
    pre_rope_keys: bool = True
    name: str = field(default="kvquant", init=False)
    fp_block_dtype: torch.dtype = field(default=torch.float16, init=False)

    def __post_init__(self):
        if self.bits not in (2, 3, 4):
            raise ValueError(f"kvquant bits must be 2, 3 or 4, got {self.bits}")
        if not 0 <= self.outlier_fraction < 1:
            raise ValueError(f"outlier_fraction must be in [0, 1), got {self.outlier_fraction}")
        if self.levels == "uniform":
            self.key_levels = self.value_levels = uniform_levels(self.bits)[None]
        elif self.levels == "nuq":
            if self.key_levels is None or self.value_levels is None:
                raise ValueError("levels='nuq' needs key_levels and value_levels (fit_nuq_levels)")
        else:
            raise ValueError(f"levels must be 'nuq' or 'uniform', got {self.levels!r}")
        self.key_levels = self._check_levels(self.key_levels, "key_levels")
        self.value_levels = self._check_levels(self.value_levels, "value_levels")
        if self.key_ranges is not None:
            if self.key_ranges.dim() != 4 or self.key_ranges.shape[2] != 2:
                raise ValueError(f"key_ranges must be [n_layers, n_kv_heads, 2, head_dim], got "
                                 f"{tuple(self.key_ranges.shape)}")
            self.key_ranges = self.key_ranges.float()

    def describe(self) -> dict:
        out = {**super().describe(), "key_ranges": "online" if self.key_ranges is None else "calibrated"}
        for extra in ("calibration", "calibration_corpus"):  # set by kvbench.quant.registry after calibrating
            if isinstance(getattr(self, extra, None), str):
                out[extra] = getattr(self, extra)
        return out

    def _check_levels(self, lv: torch.Tensor, what: str) -> torch.Tensor:
        lv = torch.as_tensor(lv, dtype=torch.float32)
        lv = lv[None] if lv.dim() == 1 else lv
        if lv.dim() != 2 or lv.shape[1] != 1 << self.bits:
            raise ValueError(f"{what} must be [n_layers, {1 << self.bits}], got {tuple(lv.shape)}")
        if (lv.diff(dim=1) < 0).any():
            raise ValueError(f"{what} must be sorted ascending")
        return lv

    @staticmethod
    def _per_layer(table: torch.Tensor, layer: int) -> torch.Tensor:
        return table[0] if table.shape[0] == 1 else table[layer]

    def _ranges(self, kind: Kind, layer: int, head, device: torch.device):
        """Calibrated key (lo, hi), each broadcastable to [n, B, D], or None (online)."""
        if kind != "key" or self.key_ranges is None:
            return None
        r = self._per_layer(self.key_ranges, layer).to(device)  # [H, 2, D]
        r = r[head] if isinstance(head, int) else r[torch.as_tensor(head, device=device)]  # [2, D] / [n, 2, D]
        return (r[..., 0:1, :], r[..., 1:2, :])  # [(n,) 1, D] each

    def _check_geometry(self, kind, block_size, head_dim):
        super()._check_geometry(kind, block_size, head_dim)
        if self.key_ranges is not None and self.key_ranges.shape[-1] != head_dim:
            raise ValueError(f"key_ranges are for head_dim {self.key_ranges.shape[-1]}, got {head_dim}")

    def _fields(self, kind, block_size, head_dim):
        numel = block_size * head_dim
        k = outlier_count(numel, self.outlier_fraction)
        out = [("codes", torch.uint8, packed_nbytes(numel, self.bits)),
               ("oval", self.outlier_dtype, k), ("oidx", torch.uint8, packed_nbytes(k, index_bits(numel)))]
        if kind == "value" or self.key_ranges is None:
            s = head_dim if kind == "key" else block_size
            out += [("lo", torch.float16, s), ("hi", torch.float16, s)]
        return out

    def _levels(self, kind: Kind, layer: int) -> torch.Tensor:
        return self._per_layer(self.key_levels if kind == "key" else self.value_levels, layer)

    def _encode(self, tile, kind, layer, head):
        n, block_size, head_dim = tile.shape
        dim = 1 if kind == "key" else 2
        q = nuq_quantize(tile, self._levels(kind, layer), dim, self.outlier_fraction,
                         self._ranges(kind, layer, head, tile.device), self.outlier_dtype)
        out = {"codes": pack_codes(q.codes.reshape(n, -1), self.bits), "oval": q.outlier_val,
               "oidx": pack_codes(q.outlier_idx, index_bits(block_size * head_dim))}
        if q.lo is not None:
            out.update(lo=q.lo, hi=q.hi)
        return out

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        numel = block_size * head_dim
        k = f["oval"].shape[1]
        codes = unpack_codes(f["codes"], self.bits, numel).view(n, block_size, head_dim)
        idx = unpack_codes(f["oidx"], index_bits(numel), k).long()
        shape = (n, 1, head_dim) if kind == "key" else (n, block_size, 1)
        lo = f["lo"].reshape(shape) if "lo" in f else None
        hi = f["hi"].reshape(shape) if "hi" in f else None
        q = NuqTensor(codes, lo, hi, idx, f["oval"])
        return nuq_dequantize(q, self._levels(kind, layer), self._ranges(kind, layer, head, codes.device))


@dataclass(eq=False)
class Int8Codec(KVCodec):
    """int8 per token, symmetric (absmax / 127, fp16 scale per token), for K and V alike."""

    layer_independent: bool = field(default=True, init=False)

    bits: int = field(default=8, init=False)
    name: str = field(default="int8", init=False)
    kernels = frozenset({"cpu_attention", "triton_attention"})

    def affine_rows(self, kind, block_size, head_dim):
        lay = self.layout(kind, block_size, head_dim)
        return AffineRows(lay.nbytes, lay.fields["codes"].offset, -1, lay.fields["scale"].offset, 8, True, False,
                          head_dim)

    def _fields(self, kind, block_size, head_dim):
        return [("codes", torch.int8, block_size * head_dim), ("scale", torch.float16, block_size)]

    def _encode(self, tile, kind, layer, head):
        codes, scale = quantize_int8_sym(tile, dim=-1)
        return {"codes": codes, "scale": scale}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        return dequantize_int8_sym(f["codes"].view(n, block_size, head_dim), f["scale"].view(n, block_size, 1))


@dataclass(eq=False)
class Fp8Codec(KVCodec):
    """fp8 e4m3 per token (torch.float8_e4m3fn) with an fp16 scale per token (amax / 448), for K and V."""

    layer_independent: bool = field(default=True, init=False)

    bits: int = field(default=8, init=False)
    name: str = field(default="fp8", init=False)

    def _fields(self, kind, block_size, head_dim):
        return [("codes", torch.uint8, block_size * head_dim), ("scale", torch.float16, block_size)]

    def _encode(self, tile, kind, layer, head):
        codes, scale = quantize_fp8(tile, dim=-1)
        return {"codes": codes.view(torch.uint8), "scale": scale}

    def _decode(self, f, kind, block_size, head_dim, layer, head):
        n = f["codes"].shape[0]
        codes = f["codes"].view(n, block_size, head_dim)  # raw e4m3 bytes
        return dequantize_fp8(codes, f["scale"].view(n, block_size, 1))

