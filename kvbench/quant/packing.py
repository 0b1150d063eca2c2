"""Bit packing of integer codes into uint8, and the byte layout of a packed block.

Bit order (the spec every packer here follows, including the Triton kernel): the codes of a row form one
little-endian bit stream; code i occupies stream bits [i*bits, (i+1)*bits), its least significant bit first,
and stream bit p lives in byte p // 8 at bit p % 8. So for 4 bits byte j = code[2j] | code[2j+1] << 4, for
2 bits byte j = code[4j] | code[4j+1] << 2 | ..., and 3-bit codes pack 8 codes into 3 bytes.
A row of n codes takes ceil(n * bits / 8) bytes; the unused high bits of the last byte are zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_FAST_BITS = (1, 2, 4, 8)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take when packed."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last dim. codes: [..., n] -> uint8 [..., ceil(n*bits/8)]."""
    _check_bits(bits)
    n = codes.shape[-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if bits in _FAST_BITS:
        per = 8 // bits  # codes per byte
        c = _pad_last(codes.to(torch.int32), -n % per).unflatten(-1, (-1, per))  # [..., nbytes, per]
        shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
        return (c << shifts).sum(-1, dtype=torch.int32).to(torch.uint8)
    if bits < 8:  # 8 codes -> one word of `bits` bytes (3 bits: 8 codes in 3 bytes)
        dt = _word_dtype(bits)
        c = _pad_last(codes.to(dt), -n % 8).unflatten(-1, (-1, 8))  # [..., words, 8]
        word = (c << (torch.arange(8, dtype=dt, device=codes.device) * bits)).sum(-1, keepdim=True, dtype=dt)
        out = (word >> (torch.arange(bits, dtype=dt, device=codes.device) * 8)) & 0xFF  # [..., words, bits]
        return out.flatten(-2)[..., : packed_nbytes(n, bits)].to(torch.uint8)
    return _pack_generic(codes, bits)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`. packed: uint8 [..., nbytes] -> codes [..., n] (uint8 if bits <= 8 else int32).

    Index with `codes.long()`: torch reads a uint8 index tensor as a boolean mask.
    """
    _check_bits(bits)
    if packed.shape[-1] != packed_nbytes(n, bits):
        raise ValueError(f"{n} codes of {bits} bits take {packed_nbytes(n, bits)} bytes, got {packed.shape[-1]}")
    if bits == 8:
        return packed
    if bits in _FAST_BITS:
        per = 8 // bits
        shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
        c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., nbytes, per]
        return c.flatten(-2)[..., :n]
    if bits < 8:
        dt = _word_dtype(bits)
        b = _pad_last(packed, -packed.shape[-1] % bits).unflatten(-1, (-1, bits)).to(dt)
        word = (b << (torch.arange(bits, dtype=dt, device=packed.device) * 8)).sum(-1, keepdim=True, dtype=dt)
        c = (word >> (torch.arange(8, dtype=dt, device=packed.device) * bits)) & ((1 << bits) - 1)
        return c.flatten(-2)[..., :n].to(torch.uint8)
    return _unpack_generic(packed, bits, n)


def _word_dtype(bits: int) -> torch.dtype:
    """Integer type holding 8 codes of `bits` bits without touching the sign bit."""
    return torch.int32 if 8 * bits <= 31 else torch.int64


def _pad_last(x: torch.Tensor, pad: int) -> torch.Tensor:
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)


def _pack_generic(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Any width 1..16 via an explicit bit stream. codes: [..., n] -> uint8 [..., ceil(n*bits/8)]."""
    n = codes.shape[-1]
    c = codes.to(torch.int32)
    planes = (c.unsqueeze(-1) >> torch.arange(bits, dtype=torch.int32, device=c.device)) & 1  # [..., n, bits]
    stream = _pad_last(planes.flatten(-2), -(n * bits) % 8).unflatten(-1, (-1, 8))  # [..., nbytes, 8]
    weights = torch.arange(8, dtype=torch.int32, device=c.device)
    return (stream << weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _unpack_generic(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `_pack_generic`. packed: uint8 [..., nbytes] -> [..., n] (uint8 if bits <= 8 else int32)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : n * bits]  # [..., n*bits]
    planes = stream.unflatten(-1, (n, bits)).to(torch.int32)  # [..., n, bits]
    weights = torch.arange(bits, dtype=torch.int32, device=packed.device)
    codes = (planes << weights).sum(-1, dtype=torch.int32)
    return codes.to(torch.uint8) if bits <= 8 else codes.to(torch.int32)


# --------------------------------------------------------------------------------------------- block layout

@dataclass(frozen=True)
class Field:
    """One section of a packed block: `numel` elements of `dtype` starting at byte `offset`."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class ByteLayout:
    """The byte layout of one packed block: named fields laid end to end in one uint8 row.

    Wider dtypes come first, so each field starts at a multiple of its item size, and the row is padded to a
    multiple of the widest item size: a row (and a whole [n_blocks, nbytes] tensor) can be viewed as any field's
    dtype without copying. The padding is real pool bytes and is counted in `nbytes`.
    """

    def __init__(self, fields: list[tuple[str, torch.dtype, int]]):
        ordered = sorted(fields, key=lambda f: -_itemsize(f[1]))  # stable: equal sizes keep their order
        offset, out = 0, []
        for name, dtype, numel in ordered:
            out.append(Field(name, dtype, int(numel), offset))
            offset += out[-1].nbytes
        self.align = max((_itemsize(d) for _, d, _ in fields), default=1)
        self.nbytes = offset + (-offset % self.align)
        self.fields = {f.name: f for f in out}

    def pack(self, **tensors: torch.Tensor) -> torch.Tensor:
        """Lay out fields (each [n_blocks, ...] with numel per block as declared) -> uint8 [n_blocks, nbytes]."""
        if set(tensors) != set(self.fields):
            raise ValueError(f"expected fields {sorted(self.fields)}, got {sorted(tensors)}")
        n = next(iter(tensors.values())).shape[0]
        first = next(iter(tensors.values()))
        out = torch.zeros(n, self.nbytes, dtype=torch.uint8, device=first.device)
        for f in self.fields.values():
            t = tensors[f.name].to(f.dtype).reshape(n, f.numel)
            out[:, f.offset : f.offset + f.nbytes] = t.contiguous().view(torch.uint8)
        return out

    def unpack(self, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
        """uint8 [n_blocks, nbytes] -> {name: [n_blocks, numel] of the field's dtype} (views when possible)."""
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != self.nbytes:
            raise ValueError(f"expected uint8 [n_blocks, {self.nbytes}], got {blocks.dtype} {tuple(blocks.shape)}")
        if blocks.stride(1) != 1 or blocks.stride(0) % self.align:
            blocks = blocks.contiguous()
        out = {}
        for f in self.fields.values():
            size = _itemsize(f.dtype)
            start = f.offset // size
            out[f.name] = blocks.view(f.dtype)[:, start : start + f.numel]
        return out


def index_bits(n: int) -> int:
    """Bits needed to address positions 0..n-1."""
    return max(1, math.ceil(math.log2(n))) if n > 1 else 1
