"""Uniform quantizers against plain-loop references: KIVI groups, int8 and fp8 per token."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvbench.quant.uniform import (dequantize_asym, dequantize_fp8, dequantize_int8_sym, fp16_round_down,
                                   fp16_round_up, quantize_asym, quantize_fp8, quantize_int8_sym)


def _f16_down(v: np.float32) -> np.float16:
    h = np.float16(v)
    return np.nextafter(h, np.float16(-np.inf)) if np.float32(h) > v else h


def _f16_up(v: np.float32) -> np.float16:
    h = np.float16(v)
    return np.nextafter(h, np.float16(np.inf)) if np.float32(h) < v else h


def ref_asym_2d(x: np.ndarray, bits: int, group: int):
    """Loop reference along the last axis of a 2-D float32 array: returns codes, mn, scale per group."""
    rows, n = x.shape
    ng = -(-n // group)
    L = (1 << bits) - 1
    codes = np.zeros_like(x, dtype=np.int64)
    mn = np.zeros((rows, ng), np.float16)
    sc = np.zeros((rows, ng), np.float16)
    for r in range(rows):
        for g in range(ng):
            seg = x[r, g * group : (g + 1) * group]
            m = _f16_down(np.float32(seg.min()))
            s = _f16_up(max(np.float32((np.float32(seg.max()) - np.float32(m)) / np.float32(L)), np.float32(2**-24)))
            mn[r, g], sc[r, g] = m, s
            for j, v in enumerate(seg):
                q = np.round(np.float32(v - np.float32(m)) / np.float32(s))
                codes[r, g * group + j] = min(max(q, 0), L)
    return codes, mn, sc


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n,group", [(64, 32), (40, 16)])  # 40 / 16: a partial last group
def test_asym_matches_loop_reference(bits, n, group):
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    codes, mn, scale = quantize_asym(x, bits, dim=1, group_size=group)
    rc, rmn, rsc = ref_asym_2d(x.numpy(), bits, group)
    assert mn.shape == scale.shape == (6, -(-n // group)) and mn.dtype == torch.float16
    assert np.array_equal(mn.numpy(), rmn) and np.array_equal(scale.numpy(), rsc)
    mismatch = (codes.long().numpy() != rc).mean()
    assert mismatch < 0.002  # equal up to fp32 ties at .5
    deq = dequantize_asym(codes, mn, scale, dim=1, group_size=group)
    err = (deq - x).abs()
    bound = scale.float().repeat_interleave(group, 1)[:, :n] / 2 + 1e-5
    assert (err <= bound).all()
    assert codes.max() <= (1 << bits) - 1


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.sampled_from([2, 4]), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_asym_error_bound_any_scale(n, bits, mag, seed):
    x = torch.randn(3, n, 5, generator=torch.Generator().manual_seed(seed)) * mag
    codes, mn, scale = quantize_asym(x, bits, dim=1, group_size=8)
    deq = dequantize_asym(codes, mn, scale, dim=1, group_size=8)
    s = scale.float().repeat_interleave(8, 1)[:, :n]
    assert ((deq - x).abs() <= s / 2 + 1e-6 * x.abs() + 1e-7).all()


def test_key_groups_run_over_tokens_per_channel():
    """KIVI keys: tile [blocks, T, D], dim=1: a token group shares one scale per channel."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 32, 8, generator=g)
    _, mn, scale = quantize_asym(x, 2, dim=1, group_size=8)
    assert scale.shape == (2, 4, 8)  # [blocks, token groups, channels]
    y = x.clone()
    y[1, 13, 5] = 50.0  # token 13 -> group 1, channel 5
    _, mn2, scale2 = quantize_asym(y, 2, dim=1, group_size=8)
    changed = (scale2 != scale) | (mn2 != mn)
    assert changed.nonzero().tolist() == [[1, 1, 5]]


def test_value_groups_run_over_channels_per_token():
    """KIVI values: dim=2: a group of G channels of one token shares a scale."""
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    _, mn, scale = quantize_asym(x, 4, dim=2, group_size=32)
    assert scale.shape == (2, 16, 2)
    y = x.clone()
    y[0, 7, 40] = -50.0  # token 7, channel group 1
    _, mn2, scale2 = quantize_asym(y, 4, dim=2, group_size=32)
    changed = (scale2 != scale) | (mn2 != mn)
    assert changed.nonzero().tolist() == [[0, 7, 1]]


def test_constant_group_is_exact_up_to_fp16():
    x = torch.full((1, 32, 4), 0.3)
    codes, mn, scale = quantize_asym(x, 2, dim=1, group_size=32)
    deq = dequantize_asym(codes, mn, scale, dim=1, group_size=32)
    assert (deq - x).abs().max() <= float(scale.float().max()) / 2 + 1e-6


def test_fp16_rounding_directions():
    x = torch.randn(1000) * 10
    d, u = fp16_round_down(x), fp16_round_up(x)
    assert d.dtype == u.dtype == torch.float16
    assert (d.float() <= x).all() and (u.float() >= x).all()
    assert ((u.float() - d.float()) <= x.abs() * 2**-9).all()  # adjacent or equal fp16 values


def test_int8_symmetric_per_token():
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(3)) * 4
    codes, scale = quantize_int8_sym(x, dim=-1)
    assert codes.dtype == torch.int8 and scale.shape == (3, 16, 1)
    for b in range(3):  # loop reference
        for t in range(16):
            s = _f16_up(np.float32(np.abs(x[b, t].numpy()).max() / np.float32(127)))
            assert scale[b, t, 0].item() == float(s)
            ref = np.clip(np.round(x[b, t].numpy() / np.float32(s)), -127, 127)
            assert (np.abs(codes[b, t].numpy() - ref) <= 1).all() and (codes[b, t].numpy() == ref).mean() > 0.99
    deq = dequantize_int8_sym(codes, scale)
    assert ((deq - x).abs() <= scale.float() / 2 + 1e-6).all()
    assert codes.abs().max() == 127  # the absmax entry of each token maps to +-127


def test_fp8_e4m3_per_token():
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 16)[:, None]
    codes, scale = quantize_fp8(x, dim=-1)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 16, 1)
    assert codes.float().abs().amax(-1).le(448).all() and codes.float().abs().amax(-1).ge(400).all()
    for b in range(3):  # loop reference: cast of x / scale, per token
        for t in range(16):
            ref = (x[b, t] / scale[b, t].float()).to(torch.float8_e4m3fn)
            assert torch.equal(codes[b, t].view(torch.uint8), ref.view(torch.uint8))
    deq = dequantize_fp8(codes, scale)
    # e4m3: 3 mantissa bits -> relative error <= 2**-4; subnormal step 2**-9 -> absolute <= 2**-10 * scale
    assert ((deq - x).abs() <= x.abs() * 2**-4 + scale.float() * 2**-10 + 1e-12).all()


def test_fp8_byte_lookup_equals_cast():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)) * 3
    codes, scale = quantize_fp8(x)
    via_bytes = dequantize_fp8(codes.view(torch.uint8), scale)
    assert torch.equal(via_bytes, dequantize_fp8(codes, scale))
    every = torch.arange(256, dtype=torch.uint8)
    finite = every.view(torch.float8_e4m3fn).float().isfinite()
    one = torch.ones(1, dtype=torch.float16)
    assert torch.equal(dequantize_fp8(every, one)[finite], every.view(torch.float8_e4m3fn).float()[finite])
