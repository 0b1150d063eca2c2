"""FP4 formats and codecs (kvbench.quant.fp4, kvbench.quant.fp4_codecs) against a plain numpy reference of each
format: E2M1 rounding (representable values exact, ties to even, saturation), NVFP4's E4M3 group scales under an
FP32 tensor scale, MXFP4's E8M0 shared exponent (OCP MX rule), all-zero groups, the packed rows, and the Triton
dequantizer (interpreter on CPU) against the codecs' own decode."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvbench.quant.fp4 import (e2m1_decode, e2m1_encode, mxfp4_dequantize, mxfp4_quantize, nvfp4_dequantize,
                               nvfp4_quantize, nvfp4_tensor_scale)
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.rotation import RotatedCodec
from tests.quant.test_codecs import triton_dequant  # noqa: F401  (the module fixture)

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


# ------------------------------------------------------------------------------------------ numpy reference
def ref_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 value by brute force (distance to all 8 magnitudes), ties to the even index, saturating."""
    mag = np.minimum(np.abs(x), 6.0)
    dist = np.abs(mag[..., None] - E2M1)  # [..., 8]
    best = dist.min(-1, keepdims=True)
    cand = dist == best  # one or two neighbours (a tie)
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return np.sign(x) * E2M1[idx]


def ref_e4m3(x: np.ndarray) -> np.ndarray:
    """Round positive x to float8 e4m3fn (round to nearest even), by enumerating its finite values."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    out = np.empty_like(x)
    for i, v in np.ndenumerate(x):
        d = np.abs(vals - v)
        c = np.flatnonzero(d == d.min())
        if len(c) == 1:
            out[i] = vals[c[0]]
        else:  # a tie: the value whose 3-bit mantissa is even
            bits = [int(torch.tensor(vals[j], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))
                    for j in c]
            out[i] = vals[c[[b % 2 == 0 for b in bits].index(True)]]
    return out


def ref_nvfp4(x: np.ndarray, amax: float) -> np.ndarray:
    """NVFP4 fake-quantization of rows x [..., n] (n % 16 == 0) with tensor amax `amax`."""
    ts = max(amax / (448 * 6), np.finfo(np.float32).tiny)
    g = x.reshape(*x.shape[:-1], -1, 16)
    s = ref_e4m3(np.clip(np.abs(g).max(-1, keepdims=True) / 6 / ts, 2.0**-9, 448))
    return (ref_e2m1(g / (s * ts)) * s * ts).reshape(x.shape)


def ref_mxfp4(x: np.ndarray) -> np.ndarray:
    """MXFP4 fake-quantization of rows x [..., n] (n % 32 == 0): X = 2**(floor(log2(amax)) - 2) per 32."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127)
    X = 2.0 ** np.clip(e, -127, 127)
    return (ref_e2m1(g / X) * X).reshape(x.shape)


# ------------------------------------------------------------------------------------------ E2M1
def test_e2m1_representable_values_ties_and_saturation():
    exact = np.concatenate([E2M1, -E2M1[1:]])
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # each between two neighbours
    x = np.concatenate([exact, ties, -ties, [6.5, 7, 1e6, -1e6, 0.1, -0.1, 0.26, 5.01]])
    got = e2m1_decode(e2m1_encode(torch.tensor(x, dtype=torch.float32))).double().numpy()
    np.testing.assert_array_equal(got, ref_e2m1(x))
    np.testing.assert_array_equal(got[: len(exact)], exact)  # representable values are exact
    np.testing.assert_array_equal(got[len(exact): len(exact) + 7], [0, 1, 1, 2, 2, 4, 4])  # ties to even
    assert got[len(exact) + 14: len(exact) + 18].tolist() == [6, 6, 6, -6]  # saturation
    assert (e2m1_encode(torch.tensor([-0.1, -0.0])) == 0).all()  # a value rounding to zero is +0


def test_e2m1_random_values_equal_the_reference():
    x = np.random.default_rng(0).normal(scale=3, size=5000)
    got = e2m1_decode(e2m1_encode(torch.tensor(x, dtype=torch.float32))).double().numpy()
    np.testing.assert_array_equal(got, ref_e2m1(x.astype(np.float32)))


# ------------------------------------------------------------------------------------------ NVFP4 / MXFP4
def _rows(seed=0, shape=(3, 4, 64)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-1])  # channels of very different sizes
    x[0, 1] = 0  # an all-zero row (every group zero)
    x[1, 2, :16] = 0  # one all-zero NVFP4 group beside non-zero ones
    return x


def test_nvfp4_equals_the_reference():
    x = _rows()
    amax = float(x.abs().max())
    codes, scales = nvfp4_quantize(x, nvfp4_tensor_scale(torch.tensor(amax)))
    got = nvfp4_dequantize(codes, scales, nvfp4_tensor_scale(torch.tensor(amax)))
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scales.shape == (3, 4, 4)
    assert torch.isfinite(got).all() and (got[0, 1] == 0).all() and (got[1, 2, :16] == 0).all()
    np.testing.assert_allclose(got.double().numpy(), ref_nvfp4(x.double().numpy(), amax), rtol=1e-6, atol=0)
    # the largest group's scale is the largest E4M3 (448): the tensor scale spends the whole range
    assert scales.view(torch.float8_e4m3fn).float().max() == 448


def test_nvfp4_exact_values_and_saturation_under_a_fixed_amax():
    ts = nvfp4_tensor_scale(torch.tensor(448 * 6.0))  # tensor scale 1: group scales are amax / 6 in E4M3
    x = torch.tensor([[6.0, 3, 1.5, -0.5, 0, 4, -6, 2] * 2])  # group amax 6: scale 1, every value representable
    codes, scales = nvfp4_quantize(x, ts)
    assert torch.equal(nvfp4_dequantize(codes, scales, ts), x)
    small = nvfp4_tensor_scale(torch.tensor(1.0))  # amax fixed at 1: larger values saturate at 1
    codes, scales = nvfp4_quantize(torch.full((1, 16), 50.0), small)
    assert torch.allclose(nvfp4_dequantize(codes, scales, small), torch.ones(1, 16))


def test_mxfp4_equals_the_reference_and_the_ocp_exponent():
    x = _rows(seed=1)
    codes, scales = mxfp4_quantize(x)
    got = mxfp4_dequantize(codes, scales)
    assert torch.isfinite(got).all() and (got[0, 1] == 0).all()
    np.testing.assert_array_equal(got.double().numpy(), ref_mxfp4(x.double().numpy()))
    amax = x.reshape(3, 4, 2, 32).abs().amax(-1)
    nz = amax > 0
    assert torch.equal(scales.long()[nz] - 127, (torch.floor(torch.log2(amax[nz])) - 2).long())
    assert (scales[~nz] == 0).all() and (scales != 255).all()  # zero groups: the smallest scale, never NaN (255)


def test_mxfp4_exact_values_and_saturation():
    x = torch.tensor([[6.0, 4, 3, 2, 1.5, 1, 0.5, 0, -6, -4, -3, -2, -1.5, -1, -0.5, 0] * 2])  # amax 6: X = 1
    codes, scales = mxfp4_quantize(x)
    assert int(scales[0, 0]) == 127 and torch.equal(mxfp4_dequantize(codes, scales), x)
    y = torch.full((1, 32), 7.5)  # floor(log2 7.5) - 2 = 0: X = 1, 7.5 saturates to 6
    codes, scales = mxfp4_quantize(y)
    assert torch.equal(mxfp4_dequantize(codes, scales), torch.full((1, 32), 6.0))


# ------------------------------------------------------------------------------------------ codecs
@pytest.mark.parametrize("codec,group,extra", [(Nvfp4Codec(), 16, 4), (Mxfp4Codec(), 32, 0)])
def test_codec_rows_two_values_a_byte_and_bits_from_the_layout(codec, group, extra):
    B, D = 16, 128
    lay = codec.layout("key", B, D)
    assert lay.fields["codes"].nbytes == B * D // 2  # two E2M1 values a byte
    assert lay.fields["scales"].nbytes == B * D // group  # one scale byte per group
    assert lay.nbytes == B * D // 2 + B * D // group + extra
    assert codec.bits_per_element(B, D) == 8 * lay.nbytes / (B * D)  # 4.53 (NVFP4), 4.25 (MXFP4)
    x = _rows(shape=(5, B, D))
    rows = codec.encode_values(x)
    ref = ref_mxfp4 if group == 32 else None
    out = codec.decode_values(rows, B, D)
    if ref is not None:
        np.testing.assert_array_equal(out.double().numpy(), ref(x.double().numpy()))
    else:  # each block is one tensor: its amax sets the FP32 scale
        for i in range(5):
            np.testing.assert_allclose(out[i].double().numpy(),
                                       ref_nvfp4(x[i].double().numpy(), float(x[i].abs().max())), rtol=1e-6)
    # nibble order: code 2j in the low nibble of byte j (a tile whose first values are 6 and -0.5 of amax 6)
    t = torch.zeros(1, B, D)
    t[0, 0, :2] = torch.tensor([6.0, -0.5])
    first = codec.layout("value", B, D).unpack(codec.encode_values(t))["codes"][0, 0].item()
    assert first == 0b0111 | 0b1001 << 4


def test_nvfp4_fixed_tensor_amax_and_refusals():
    c = Nvfp4Codec(tensor_amax=2688.0)  # tensor scale 1
    rows = c.encode_keys(torch.ones(1, 16, 16) * 3)
    assert c.layout("key", 16, 16).unpack(rows)["tensor_scale"].item() == 1.0
    assert torch.equal(c.decode_keys(rows, 16, 16), torch.full((1, 16, 16), 3.0))
    with pytest.raises(ValueError, match="tensor_amax"):
        Nvfp4Codec(tensor_amax=-1.0)


@pytest.mark.parametrize("make", [Nvfp4Codec, Mxfp4Codec, lambda: RotatedCodec(Nvfp4Codec(), seed=3)],
                         ids=["nvfp4", "mxfp4", "nvfp4_rotated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("geom", [(16, 64), (32, 128), (16, 48)])  # (B, D); D=48: a partial MXFP4 group
def test_triton_fp4_dequant_matches_torch(triton_dequant, make, dtype, geom):  # noqa: F811
    b, d = geom
    codec = make()
    if isinstance(codec, RotatedCodec) and d & (d - 1):
        pytest.skip("the rotation needs a power-of-two head_dim")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _rows(seed=4, shape=(3, b, d)).to(dtype)
    for kind in ("key", "value"):
        rows = (codec.encode_keys if kind == "key" else codec.encode_values)(x)
        ref = (codec.decode_keys if kind == "key" else codec.decode_values)(rows, b, d)
        out = triton_dequant.dequantize_rows(codec, rows.to(device), kind, b, d)
        assert out.shape == (3, b, d) and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-6, atol=1e-6)
        assert (out.cpu() - x.float()).abs().max() > 0  # it really is quantized data
