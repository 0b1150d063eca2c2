"""KVQuant non-uniform quantization (nuqX) with dense-and-sparse outliers.

A vector (one channel of a key block, or one token of a value block) is normalized to [-1, 1] by its range
[lo, hi] (mid = (lo + hi) / 2, half = (hi - lo) / 2) and each element is replaced by the nearest level of a
per-layer level set (2**bits sorted values in [-1, 1]). Outliers are kept exactly, in a sparse list.

Outlier budget: a packed block has a fixed byte size, so the count is fixed per block:
k = ceil(outlier_fraction * block_size * head_dim) entries per block, chosen by how far each entry sits from
its own vector (so the choice is per vector, the budget per block; 1% of a 32-token channel is 0.32 entries,
which a per-vector count cannot express). Ranges come either
- online (values, and keys without calibration): the min / max of each vector's non-outlier entries, stored
  in the block as fp16 (lo rounded down, hi rounded up); outliers = top-k by |x - mean| / std in the vector; or
- calibrated (keys, as in KVQuant): per-channel thresholds [lo, hi] fitted offline (`fit_channel_ranges`),
  not stored per block; outliers = top-k by |x - mid| / half, entries beyond the thresholds that do not fit
  the budget are clipped to the range.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvbench.quant.uniform import FP16_MAX, fp16_round_down, fp16_round_up


def uniform_levels(bits: int) -> torch.Tensor:
    """The uniform level set for the ablation (intX): 2**bits evenly spaced levels over [-1, 1]."""
    return torch.linspace(-1.0, 1.0, 1 << bits)


def fit_nuq_levels(samples: torch.Tensor, bits: int, weights: torch.Tensor | None = None, iters: int = 100,
                   seed: int = 0, max_samples: int = 1 << 22, tol: float = 1e-7) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) for a level set: minimize sum_i w_i (x_i - level(x_i))**2.

    samples: [N] calibration values already normalized to [-1, 1] (see `dense_normalized`); weights: [N]
    non-negative sensitivities (KVQuant: squared gradients, a Fisher information diagonal), or None for plain
    k-means. Initialized at weighted quantiles; deterministic given `seed` (only used to subsample when
    N > max_samples). Returns float32 [2**bits], sorted ascending.
    """
    x = samples.detach().reshape(-1).float().cpu()
    w = torch.ones_like(x) if weights is None else weights.detach().reshape(-1).float().cpu()
    if w.shape != x.shape:
        raise ValueError(f"weights {tuple(w.shape)} must match samples {tuple(x.shape)}")
    if (w < 0).any() or not torch.isfinite(w).all() or not torch.isfinite(x).all():
        raise ValueError("samples and weights must be finite and weights non-negative")
    if x.numel() > max_samples:
        g = torch.Generator().manual_seed(seed)
        keep = torch.randperm(x.numel(), generator=g)[:max_samples]
        x, w = x[keep], w[keep]
    if x.numel() == 0 or float(w.sum()) <= 0:
        raise ValueError("need samples with positive total weight")
    n_levels = 1 << bits
    order = torch.argsort(x)
    xs, ws = x[order], w[order]
    cum = torch.cumsum(ws, 0) / ws.sum()
    targets = (torch.arange(n_levels, dtype=torch.float32) + 0.5) / n_levels
    centers = xs[torch.searchsorted(cum, targets).clamp_(max=xs.numel() - 1)]
    # the samples are sorted, so each cluster is a run: its weight and weighted sum are differences of prefix
    # sums at the cuts (O(levels log N) per iteration instead of assigning all N samples)
    zero = torch.zeros(1, dtype=torch.float64)
    cw = torch.cat([zero, torch.cumsum(ws.double(), 0)])
    cwx = torch.cat([zero, torch.cumsum(ws.double() * xs.double(), 0)])
    ends = torch.tensor([xs.numel()])
    for _ in range(iters):
        # a sample on a midpoint goes to the lower level (torch.bucketize's default)
        cuts = torch.searchsorted(xs, (centers[1:] + centers[:-1]) / 2, right=True)
        lo, hi = torch.cat([torch.zeros(1, dtype=torch.long), cuts]), torch.cat([cuts, ends])
        wsum, xsum = cw[hi] - cw[lo], cwx[hi] - cwx[lo]
        new = torch.where(wsum > 0, xsum / wsum.clamp_min(1e-300), centers.double()).float().sort().values
        done = float((new - centers).abs().max()) < tol
        centers = new
        if done:
            break
    return centers.contiguous()


def fit_channel_ranges(x: torch.Tensor, outlier_fraction: float = 0.01) -> torch.Tensor:
    """Offline per-channel thresholds for keys: quantiles f/2 and 1 - f/2 of each channel over tokens.

    x: [..., N tokens, D] calibration keys (pre-RoPE for KVQuant) -> [..., 2, D] (row 0 lower, row 1 upper).
    """
    xs = x.float().sort(dim=-2).values
    n = xs.shape[-2]
    lo_i = min(n - 1, int(math.floor(outlier_fraction / 2 * n)))
    hi_i = max(0, n - 1 - lo_i)
    return torch.stack([xs[..., lo_i, :], xs[..., hi_i, :]], dim=-2)


def outlier_count(numel: int, outlier_fraction: float) -> int:
    """Outliers kept per block: ceil(fraction * elements in the block)."""
    return math.ceil(outlier_fraction * numel - 1e-9) if outlier_fraction > 0 else 0


@dataclass
class NuqTensor:
    """A dense-and-sparse quantized tile [n, B, D].

    codes: uint8 [n, B, D] level indices; lo / hi: fp16 range per vector (keepdim over the vector dim, e.g.
    [n, 1, D] for keys per channel) or None when calibrated ranges are used; outlier_idx: int64 [n, k] flat
    positions inside the block (sorted); outlier_val: [n, k] exact values.
    """

    codes: torch.Tensor
    lo: torch.Tensor | None
    hi: torch.Tensor | None
    outlier_idx: torch.Tensor
    outlier_val: torch.Tensor


def nearest_level(xn: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level (ties to the lower one). xn: any shape; levels: [L] sorted -> uint8 like xn.

    Counts the midpoints below each entry (the same as torch.bucketize on the midpoints, faster on CPU for the
    <= 16 levels used here; figures: docs/benchmark-results.md).
    """
    lv = levels.float()
    codes = torch.zeros(xn.shape, dtype=torch.uint8, device=xn.device)
    for m in ((lv[1:] + lv[:-1]) / 2).tolist():
        codes += xn > m
    return codes


def _mid_half(lo: torch.Tensor, hi: torch.Tensor):
    lo, hi = lo.float(), hi.float()
    return (lo + hi) / 2, (hi - lo) / 2


def _normalize(x: torch.Tensor, mid: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    """(x - mid) / half clipped to [-1, 1]; 0 where the range is empty."""
    ok = half > 0
    return torch.where(ok, ((x - mid) / torch.where(ok, half, torch.ones_like(half))).clamp(-1, 1),
                       torch.zeros_like(x))


def _select_outliers(x: torch.Tensor, dim: int, k: int, ranges) -> torch.Tensor:
    """Flat in-block positions [n, k] (sorted) of the k entries farthest from their own vector."""
    n = x.shape[0]
    if k == 0:
        return torch.zeros(n, 0, dtype=torch.long, device=x.device)
    if ranges is not None:
        mid, half = _mid_half(*ranges)
        score = (x - mid).abs() / half.clamp_min(1e-30)
    else:
        mean = x.mean(dim, keepdim=True)
        std = x.std(dim, keepdim=True, correction=0)
        score = (x - mean).abs() / (std + 1e-30)
    return score.reshape(n, -1).topk(k, dim=1).indices.sort(dim=1).values


def dense_sparse_split(x: torch.Tensor, dim: int, outlier_fraction: float, ranges=None):
    """Choose outliers and ranges. x: [n, B, D]; `dim` is the axis a vector runs along (1: one vector per
    channel; 2: one vector per token). ranges: optional calibrated (lo, hi) broadcastable to x.

    Returns (outlier_idx [n, k], lo, hi, online), lo / hi fp16 keepdim over `dim` when online.
    """
    x = x.float()
    n = x.shape[0]
    k = outlier_count(x[0].numel(), outlier_fraction)
    idx = _select_outliers(x, dim, k, ranges)
    if ranges is not None:
        return idx, ranges[0], ranges[1], False
    mask = torch.zeros(n, x[0].numel(), dtype=torch.bool, device=x.device).scatter_(1, idx, True).view_as(x)
    lo = x.masked_fill(mask, float("inf")).amin(dim, keepdim=True)
    hi = x.masked_fill(mask, -float("inf")).amax(dim, keepdim=True)
    empty = lo > hi  # every entry of the vector is an outlier
    lo = torch.where(empty, torch.zeros_like(lo), lo).clamp(-FP16_MAX, FP16_MAX)
    hi = torch.where(empty, torch.zeros_like(hi), hi).clamp(-FP16_MAX, FP16_MAX)
    return idx, fp16_round_down(lo), fp16_round_up(hi), True


def nuq_quantize(x: torch.Tensor, levels: torch.Tensor, dim: int, outlier_fraction: float = 0.01,
                 ranges=None, outlier_dtype: torch.dtype = torch.float16) -> NuqTensor:
    """Dense-and-sparse nuq quantization of a tile. x: [n, B, D]; levels: [L] sorted in [-1, 1].

    dim=1: keys per channel; dim=2: values per token. ranges: calibrated (lo, hi) broadcastable to x, else
    online per-vector ranges over the non-outlier entries.
    """
    if x.dim() != 3:
        raise ValueError(f"expected a tile [n, B, D], got {tuple(x.shape)}")
    xf = x.float()
    idx, lo, hi, online = dense_sparse_split(xf, dim, outlier_fraction, ranges)
    mid, half = _mid_half(lo, hi)
    xn = _normalize(xf, mid, half)
    codes = nearest_level(xn, levels)
    vals = xf.reshape(xf.shape[0], -1).gather(1, idx).to(outlier_dtype)
    return NuqTensor(codes, lo if online else None, hi if online else None, idx, vals)


def nuq_dequantize(q: NuqTensor, levels: torch.Tensor, ranges=None, dtype: torch.dtype = torch.float32):
    """Inverse of `nuq_quantize`: levels[code] * half + mid, then the exact outliers scattered back."""
    if q.lo is None and ranges is None:
        raise ValueError("calibrated tile: pass the same ranges used to quantize")
    lo, hi = (q.lo, q.hi) if q.lo is not None else ranges
    mid, half = _mid_half(lo, hi)
    lv = levels.float().to(q.codes.device)
    out = lv.index_select(0, q.codes.reshape(-1).long()).view(q.codes.shape)  # [n, B, D]
    out = torch.addcmul(mid, out, half)
    n = out.shape[0]
    out = out.reshape(n, -1).scatter(1, q.outlier_idx, q.outlier_val.float()).view_as(out)
    return out.to(dtype)


def dense_normalized(x: torch.Tensor, dim: int, outlier_fraction: float = 0.01, ranges=None):
    """Calibration helper: the normalized values the quantizer would round, for fitting level sets.

    x: [n, B, D] -> (xn [n, B, D] in [-1, 1], dense_mask bool [n, B, D]); fit on xn[dense_mask] (with the
    matching squared gradients as weights for sensitivity-weighted k-means).
    """
    xf = x.float()
    idx, lo, hi, _ = dense_sparse_split(xf, dim, outlier_fraction, ranges)
    mid, half = _mid_half(lo, hi)
    n = xf.shape[0]
    mask = torch.ones(n, xf[0].numel(), dtype=torch.bool, device=x.device).scatter_(1, idx, False).view_as(xf)
    return _normalize(xf, mid, half), mask
