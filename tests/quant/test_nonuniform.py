"""KVQuant nuq: level fitting, dense-and-sparse outliers, per-vector ranges, against loop references."""
import math

import numpy as np
import pytest
import torch

from kvbench.quant.nonuniform import (dense_normalized, fit_channel_ranges, fit_nuq_levels, nuq_dequantize,
                                      nuq_quantize, outlier_count, uniform_levels)
from kvbench.quant.uniform import fp16_round_down, fp16_round_up


def _f16_down(v):
    h = np.float16(v)
    return np.nextafter(h, np.float16(-np.inf)) if np.float32(h) > v else h


def _f16_up(v):
    h = np.float16(v)
    return np.nextafter(h, np.float16(np.inf)) if np.float32(h) < v else h


def ref_nuq_online(x: np.ndarray, levels: np.ndarray, dim: int, frac: float):
    """Loop reference for one tile [B, D] (online ranges): returns decoded [B, D] and the outlier set."""
    B, D = x.shape
    vecs = [(slice(None), c) for c in range(D)] if dim == 1 else [(t, slice(None)) for t in range(B)]
    score = np.zeros_like(x, dtype=np.float64)
    for v in vecs:
        seg = x[v].astype(np.float64)
        score[v] = np.abs(seg - seg.mean()) / (seg.std() + 1e-30)
    k = math.ceil(frac * B * D - 1e-9)
    flat = sorted(range(B * D), key=lambda i: -score.flat[i])[:k]
    out_set = set(flat)
    dec = np.zeros_like(x)
    for v in vecs:
        pos = np.arange(B * D).reshape(B, D)[v]
        dense = [x.flat[p] for p in pos if p not in out_set]
        lo = _f16_down(np.float32(min(dense))) if dense else np.float16(0)
        hi = _f16_up(np.float32(max(dense))) if dense else np.float16(0)
        mid, half = (np.float32(lo) + np.float32(hi)) / 2, (np.float32(hi) - np.float32(lo)) / 2
        for p in pos:
            if p in out_set:
                dec.flat[p] = np.float16(x.flat[p])  # fp16 outlier storage
                continue
            xn = np.clip((x.flat[p] - mid) / half, -1, 1) if half > 0 else 0.0
            lv = levels[np.argmin(np.abs(levels - xn))]
            dec.flat[p] = lv * half + mid
    return dec, out_set


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [1, 2])  # 1: keys per channel, 2: values per token
def test_nuq_matches_loop_reference(bits, dim):
    g = torch.Generator().manual_seed(10 * bits + dim)
    x = torch.randn(2, 16, 32, generator=g) * torch.rand(1, 1, 32, generator=g) * 3
    levels = torch.sort(torch.rand(1 << bits, generator=g) * 2 - 1).values
    q = nuq_quantize(x, levels, dim, outlier_fraction=0.02)
    deq = nuq_dequantize(q, levels)
    k = outlier_count(16 * 32, 0.02)
    assert q.outlier_idx.shape == (2, k) == q.outlier_val.shape and k == 11
    for b in range(2):
        ref, out_set = ref_nuq_online(x[b].numpy(), levels.numpy(), dim, 0.02)
        assert set(q.outlier_idx[b].tolist()) == out_set
        assert np.allclose(deq[b].numpy(), ref, atol=1e-5, rtol=1e-5)


def test_outliers_kept_exactly_and_ranges_exclude_them():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, 64, generator=g).half().float()  # fp16-representable: fp16 storage is exact
    planted = [(0, 3, 7), (1, 30, 63), (2, 0, 0), (2, 17, 40)]
    for b, t, c in planted:
        x[b, t, c] = 300.0 if c % 2 else -250.0
    for dim in (1, 2):
        levels = uniform_levels(3)
        q = nuq_quantize(x, levels, dim, outlier_fraction=0.01)
        deq = nuq_dequantize(q, levels)
        for b, t, c in planted:
            assert t * 64 + c in q.outlier_idx[b].tolist()
            assert deq[b, t, c] == x[b, t, c]
        flat_x, flat_d = x.reshape(3, -1), deq.reshape(3, -1)
        assert torch.equal(flat_d.gather(1, q.outlier_idx), flat_x.gather(1, q.outlier_idx))
        # the dense range is clipped to the non-outlier entries: no planted value stretches it
        assert q.hi.float().max() < 10 and q.lo.float().min() > -10
        mask = torch.ones_like(flat_x, dtype=torch.bool).scatter_(1, q.outlier_idx, False).view_as(x)
        dense_max = x.masked_fill(~mask, -1e9).amax(dim, keepdim=True)
        dense_min = x.masked_fill(~mask, 1e9).amin(dim, keepdim=True)
        assert torch.equal(q.hi, fp16_round_up(dense_max)) and torch.equal(q.lo, fp16_round_down(dense_min))
        half = (q.hi.float() - q.lo.float()) / 2
        err = (deq - x).abs()
        assert (err[mask] <= (half * (2 / 7) / 2 + 1e-5).expand_as(x)[mask]).all()  # uniform int3 step / 2


def test_dense_entries_round_to_nearest_level():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 16, 64, generator=g)
    levels = fit_nuq_levels(torch.randn(5000, generator=g).clamp(-1, 1), 3)
    q = nuq_quantize(x, levels, dim=2, outlier_fraction=0.01)
    xn, mask = dense_normalized(x, dim=2, outlier_fraction=0.01)
    dist = (xn.unsqueeze(-1) - levels).abs()  # [n, B, D, L]
    chosen = dist.gather(-1, q.codes.long().unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(chosen[mask], dist.amin(-1)[mask])
    assert (mask.reshape(4, -1).sum(1) == 16 * 64 - outlier_count(16 * 64, 0.01)).all()
    assert xn.abs().max() <= 1


def test_ranges_per_channel_for_keys_per_token_for_values():
    x = torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(6))
    lv = uniform_levels(3)
    qk, qv = nuq_quantize(x, lv, 1, 0.0), nuq_quantize(x, lv, 2, 0.0)
    assert qk.lo.shape == (1, 1, 16) and qv.lo.shape == (1, 32, 1)
    y = x.clone()
    y[0, 5, 9] = 40.0  # no outlier budget: this entry stretches its vector's range only
    qk2, qv2 = nuq_quantize(y, lv, 1, 0.0), nuq_quantize(y, lv, 2, 0.0)
    assert (qk2.hi != qk.hi).nonzero().tolist() == [[0, 0, 9]]
    assert (qv2.hi != qv.hi).nonzero().tolist() == [[0, 5, 0]]


def test_calibrated_ranges_clip_and_store_no_range():
    g = torch.Generator().manual_seed(7)
    calib = torch.randn(4000, 8, generator=g)
    r = fit_channel_ranges(calib, 0.01)  # [2, D]
    assert r.shape == (2, 8)
    assert torch.allclose(r[0], torch.quantile(calib, 0.005, dim=0), atol=0.05)
    assert torch.allclose(r[1], torch.quantile(calib, 0.995, dim=0), atol=0.05)
    x = torch.randn(2, 32, 8, generator=g)
    x[0, 4, 2] = 20.0  # far outside the thresholds: stored exactly
    ranges = (r[0:1].unsqueeze(0), r[1:2].unsqueeze(0))  # [1, 1, D] each
    lv = uniform_levels(3)
    q = nuq_quantize(x, lv, 1, 0.01, ranges=ranges)
    assert q.lo is None and q.hi is None
    deq = nuq_dequantize(q, lv, ranges=ranges)
    assert deq[0, 4, 2] == 20.0
    mask = torch.ones(2, 256, dtype=torch.bool).scatter_(1, q.outlier_idx, False).view_as(x)
    assert (deq[mask] >= r[0].expand_as(x)[mask] - 1e-6).all() and (deq[mask] <= r[1].expand_as(x)[mask] + 1e-6).all()
    with pytest.raises(ValueError):
        nuq_dequantize(q, lv)


def test_fit_levels_kmeans_properties():
    g = torch.Generator().manual_seed(8)
    centers = torch.tensor([-0.8, -0.2, 0.3, 0.9])
    s = (centers[torch.randint(0, 4, (20000,), generator=g)] + 0.01 * torch.randn(20000, generator=g))
    lv = fit_nuq_levels(s, 2)
    assert lv.shape == (4,) and torch.all(lv[1:] >= lv[:-1])
    assert torch.allclose(lv, centers, atol=0.01)
    # fixed point: each level is the mean of the samples nearest to it
    x = torch.rand(30000, generator=g) ** 2 * 2 - 1
    lv = fit_nuq_levels(x, 3, iters=300)
    assign = torch.bucketize(x, (lv[1:] + lv[:-1]) / 2)
    means = torch.stack([x[assign == i].mean() for i in range(8)])
    assert torch.allclose(lv, means, atol=1e-3)
    mse = lambda levels: ((x.unsqueeze(1) - levels).abs().amin(1) ** 2).mean()
    assert mse(lv) < mse(uniform_levels(3))


def test_fit_levels_weighted_and_deterministic():
    g = torch.Generator().manual_seed(9)
    x = torch.rand(20000, generator=g) * 2 - 1
    plain = fit_nuq_levels(x, 3)
    assert torch.equal(plain, fit_nuq_levels(x, 3, weights=torch.ones_like(x)))
    w = torch.where(x > 0, 100.0, 1.0)  # sensitive region: x > 0
    weighted = fit_nuq_levels(x, 3, weights=w)
    assert (weighted > 0).sum() > (plain > 0).sum()
    a = fit_nuq_levels(x, 4, max_samples=5000, seed=3)
    assert torch.equal(a, fit_nuq_levels(x, 4, max_samples=5000, seed=3))
    assert not torch.equal(a, fit_nuq_levels(x, 4, max_samples=5000, seed=4))
    with pytest.raises(ValueError):
        fit_nuq_levels(x, 3, weights=-w)


def test_uniform_levels_and_outlier_count():
    assert torch.allclose(uniform_levels(2), torch.tensor([-1, -1 / 3, 1 / 3, 1]))
    assert outlier_count(2048, 0.01) == 21 and outlier_count(2048, 0.0) == 0 and outlier_count(100, 0.01) == 1
