"""How to select: keep sets from scores (per kv-head top-k, a layer's joint top-k), and realigning per-slot state.

A keep set is [H, n] slot indices per kv-head, sorted ascending, -1 padding a head that keeps fewer: what the
cache's `keep_tokens` takes.
"""
from __future__ import annotations

import torch


def sort_keep(idx: torch.Tensor, size: int) -> torch.Tensor:
    """idx [H, n] slot indices (-1 = none) -> sorted ascending per row, -1 pads moved to the end."""
    big = torch.where(idx < 0, torch.full_like(idx, size), idx)
    out = big.sort(dim=-1).values
    return torch.where(out >= size, torch.full_like(out, -1), out)


def valid_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """lengths [H] -> [H, T] True where slot t holds a token."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def top_tokens(scores: torch.Tensor, k: int, lengths: torch.Tensor, *, recent: int = 0, sinks: int = 0) -> torch.Tensor:
    """Keep set [H, min(k, T)] (sorted slot indices, -1 pads) of the k best tokens per head.

    scores [H, T] (higher = keep); lengths [H] valid slots per head. The last `recent` and the first
    `sinks` slots of each head are kept first (they count towards k).
    """
    H, T = scores.shape
    k = min(k, T)
    if k <= 0:
        return torch.empty(H, 0, dtype=torch.int64, device=scores.device)
    valid = valid_mask(lengths, T)
    s = scores.float().masked_fill(~valid, float("-inf"))
    ar = torch.arange(T, device=scores.device)[None, :]
    protect = torch.zeros_like(valid)
    if recent > 0:
        protect |= ar >= (lengths[:, None] - recent)
    if sinks > 0:
        protect |= ar < sinks
    s = s.masked_fill(protect & valid, float("inf"))
    idx = s.topk(k, dim=-1).indices  # [H, k]
    idx = torch.where(valid.gather(-1, idx), idx, torch.full_like(idx, -1))
    return sort_keep(idx, T)


def top_tokens_in_layer(scores: torch.Tensor, total: int, lengths: torch.Tensor, *, recent: int = 0,
                        min_per_head: int = 0) -> torch.Tensor:
    """Head-adaptive keep set [H, n] (sorted slot indices, -1 pads; n = the most any head keeps) of one layer.

    The `total` best (kv-head, token) pairs of the layer are chosen jointly over all its heads (Ada-KV's budget
    allocation), so heads keep different numbers of tokens. scores [H, T] (higher = keep); lengths [H] valid
    slots per head. Each head first keeps its last `recent` slots and its `min_per_head` best tokens (Ada-KV's
    safeguard); these count towards `total`, which must cover them (H * max(recent, min_per_head) <= total).
    """
    H, T = scores.shape
    valid = valid_mask(lengths, T)
    total = min(total, int(lengths.sum()))
    # a score of +inf from the scorer (e.g. SnapKV's window) ranks below the protected slots
    s = scores.float().clamp(max=torch.finfo(torch.float32).max).masked_fill(~valid, float("-inf"))
    protect = torch.zeros_like(valid)
    if recent > 0:
        protect |= torch.arange(T, device=scores.device)[None, :] >= (lengths[:, None] - recent)
    if min_per_head > 0:
        best = s.topk(min(min_per_head, T), dim=-1).indices  # [H, m]
        protect.scatter_(-1, best, True)
    s = s.masked_fill(protect & valid, float("inf"))
    flat = s.reshape(-1).topk(total).indices  # [total] over H*T
    chosen = torch.zeros(H * T, dtype=torch.bool, device=scores.device)
    chosen[flat] = True
    chosen = chosen.view(H, T) & valid
    n = int(chosen.sum(-1).max()) if total > 0 else 0
    # the chosen slots of each head, in slot order, padded with -1: sort (not chosen) last, stable
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)[:, :n]  # [H, n]
    return torch.where(chosen.gather(-1, order), order, torch.full_like(order, -1))


def gather_aligned(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-slot values [H, T] -> [H, n] following keep [H, n] (-1 pads give 0)."""
    out = values.gather(-1, keep.clamp(min=0))
    return out.masked_fill(keep < 0, 0)
