"""Paged attention, plain-torch reference.

A causal chunk of Q new queries per sequence against each sequence's cached tokens (which already
include the chunk's own K/V), for a batch whose sequences and kv-heads hold different numbers of
tokens. GQA: query head hq reads kv head hq // group.
"""
from __future__ import annotations

from typing import Callable

import torch


def paged_attention_torch(
    q: torch.Tensor,  # [S, Hq, Q, D]
    k_pool: torch.Tensor,  # [num_blocks, bs, D]
    v_pool: torch.Tensor,  # [num_blocks, bs, D]
    tables: torch.Tensor,  # [S, H, MB] int32
    lengths: torch.Tensor,  # [S, H] int64
    key_positions: torch.Tensor,  # [S, H, MB*bs] int32
    query_positions: torch.Tensor,  # [S, Q] int64
    scale: float,
    *,
    return_key_scores: bool = False,
    rotate_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out [S, Hq, Q, D], key_scores [S, H, T] or None).

    key_scores[s, h, t] = attention probability key slot t received, summed over the query heads of
    kv head h and over the Q queries (what H2O-style methods accumulate).
    rotate_keys(k [S, H, T, D], slot_index [S, H, T]) -> k: applied to gathered keys when the cache
    stores them before RoPE. causal=False skips the position mask (valid when every cached key
    precedes every query, as in plain decoding).
    """
    S, Hq, Q, D = q.shape
    H = tables.shape[1]
    G = Hq // H
    bs = k_pool.shape[1]
    T = int(lengths.max())
    nb = -(-T // bs)
    Tp = nb * bs
    idx = tables[:, :, :nb].to(torch.int64)  # [S, H, nb]
    k = k_pool[idx].view(S, H, Tp, D)
    v = v_pool[idx].view(S, H, Tp, D)
    if rotate_keys is not None:
        k = rotate_keys(k, key_positions[:, :, :Tp])
    qg = q.reshape(S, H, G * Q, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [S, H, G*Q, Tp]
    valid = torch.arange(Tp, device=q.device) < lengths.unsqueeze(-1)  # [S, H, Tp]
    if causal:
        kp = key_positions[:, :, :Tp]
        vis = valid[:, :, None, :] & (kp[:, :, None, :] <= query_positions[:, None, :, None])  # [S, H, Q, Tp]
        mask = vis.unsqueeze(2).expand(S, H, G, Q, Tp).reshape(S, H, G * Q, Tp)
    else:
        mask = valid[:, :, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no visible key
    out = torch.matmul(probs.to(v.dtype), v).view(S, Hq, Q, D)
    key_scores = probs.sum(dim=2)[:, :, :T] if return_key_scores else None
    return out, key_scores
