"""Bit packing and block byte layouts: lossless, and the documented little-endian bit stream."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvbench.quant.packing import (ByteLayout, _pack_generic, index_bits, pack_codes, packed_nbytes,
                                   unpack_codes)

BITS = [1, 2, 3, 4, 5, 8, 11, 16]


def ref_pack(codes: list[int], bits: int) -> bytes:
    """Plain reference: one Python int as the bit stream, code i at bits [i*bits, (i+1)*bits)."""
    acc = 0
    for i, c in enumerate(codes):
        acc |= c << (i * bits)
    return acc.to_bytes((len(codes) * bits + 7) // 8, "little")


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(BITS), st.data())
def test_pack_matches_reference_and_roundtrips(bits, data):
    codes = data.draw(st.lists(st.integers(0, (1 << bits) - 1), min_size=0, max_size=70))
    t = torch.tensor(codes, dtype=torch.int32).reshape(1, len(codes))
    packed = pack_codes(t, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (1, packed_nbytes(len(codes), bits))
    assert bytes(packed[0].tolist()) == ref_pack(codes, bits)
    back = unpack_codes(packed, bits, len(codes))
    assert back.tolist() == [codes]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_code_survives_batched(bits):
    g = torch.Generator().manual_seed(bits)
    all_codes = torch.arange(1 << bits).repeat(8)  # every code, several times, at varied bit offsets
    codes = torch.stack([all_codes[torch.randperm(all_codes.numel(), generator=g)] for _ in range(6)])
    codes = codes.view(2, 3, -1)  # [2, 3, n]
    packed = pack_codes(codes, bits)
    assert packed.shape == (2, 3, codes.shape[-1] * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, codes.shape[-1]).long(), codes)


def test_three_bit_packs_eight_codes_in_three_bytes():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    packed = pack_codes(codes, 3)
    assert packed.shape == (1, 3)
    word = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert packed[0].tolist() == list(word.to_bytes(3, "little"))


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_fast_path_equals_generic_layout(bits):
    codes = torch.randint(0, 1 << bits, (4, 37), generator=torch.Generator().manual_seed(0))
    assert torch.equal(pack_codes(codes, bits), _pack_generic(codes, bits))


def test_nibble_order():
    assert pack_codes(torch.tensor([0x3, 0xA]), 4).tolist() == [0xA3]
    assert pack_codes(torch.tensor([1, 2, 3, 0]), 2).tolist() == [1 | 2 << 2 | 3 << 4]


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError):
        unpack_codes(torch.zeros(1, 3, dtype=torch.uint8), 4, 8)
    with pytest.raises(ValueError):
        pack_codes(torch.zeros(4, dtype=torch.long), 17)


def test_index_bits():
    assert [index_bits(n) for n in (1, 2, 3, 4, 5, 2048, 2049)] == [1, 1, 2, 2, 3, 11, 12]


def test_byte_layout_roundtrip_and_alignment():
    lay = ByteLayout([("codes", torch.uint8, 5), ("scale", torch.float16, 3), ("val", torch.float32, 2)])
    # wider fields first, each at a multiple of its item size; row padded to the widest item size
    assert lay.fields["val"].offset == 0 and lay.fields["scale"].offset == 8 and lay.fields["codes"].offset == 14
    assert lay.nbytes == 20
    n = 4
    src = {"codes": torch.randint(0, 256, (n, 5), dtype=torch.uint8), "scale": torch.randn(n, 3).half(),
           "val": torch.randn(n, 2)}
    rows = lay.pack(**src)
    assert rows.shape == (n, 20) and rows.dtype == torch.uint8
    pool = torch.zeros(10, 20, dtype=torch.uint8)
    pool[[7, 2, 5, 0]] = rows  # rows scattered in a pool, read back through a gather
    out = lay.unpack(pool[[7, 2, 5, 0]])
    for k, v in src.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v)
    with pytest.raises(ValueError):
        lay.pack(codes=src["codes"], scale=src["scale"])
