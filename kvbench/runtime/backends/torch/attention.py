"""Paged attention, plain-torch reference.

A causal chunk of Q new queries per sequence against each sequence's cached tokens (which already
include the chunk's own K/V), for a batch whose sequences and kv-heads hold different numbers of
tokens. GQA: query head hq reads kv head hq // group. Blocks are read in place from the pool
(one index_select per K and V); nothing in the pool is moved.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def gather_blocks(pool: torch.Tensor, tables: torch.Tensor, nb: int) -> torch.Tensor:
    """pool [N, bs, D], tables [S, H, MB] -> [S, H, nb*bs, D] (the first nb blocks of each table)."""
    S, H = tables.shape[:2]
    bs, D = pool.shape[1], pool.shape[2]
    idx = tables[:, :, :nb].reshape(-1).to(torch.int64)
    return pool.index_select(0, idx).view(S, H, nb * bs, D)


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
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out [S, Hq, Q, D], key_scores [S, H, T] or None), T = lengths.max().

    key_scores[s, h, t] = attention probability key slot t received, summed over the query heads of
    kv head h and over the Q queries (what H2O-style methods accumulate).
    rotate_keys(k [S, H, Tp, D], key_positions [S, H, Tp]) -> k: applied to gathered keys when the
    cache stores them before RoPE. causal=False skips the position mask (valid when every cached
    key precedes every query, as in plain decoding); with one query it is `paged_decode_torch` (T = every slot
    of the tables' width).
    The attention variants of kvbench.runtime.model.attention_types (any of them turns the position mask on):
    window: query p sees the keys at positions > p - window (a sliding layer, transformers' sliding_window);
    sinks [Hq]: a learned logit per query head that joins each row's softmax and is dropped after it (GPT-OSS);
    softcap: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2).
    """
    S, Hq, Q, D = q.shape
    variant = window is not None or sinks is not None or softcap is not None
    causal = causal or variant
    if Q == 1 and not causal:
        return paged_decode_torch(q, k_pool, v_pool, tables, lengths, scale, return_key_scores=return_key_scores,
                                  rotate_keys=rotate_keys, key_positions=key_positions)
    H = tables.shape[1]
    G = Hq // H
    bs = k_pool.shape[1]
    T = int(lengths.max())
    nb = -(-T // bs)
    Tp = nb * bs
    k = gather_blocks(k_pool, tables, nb)  # [S, H, Tp, D]
    v = gather_blocks(v_pool, tables, nb)
    if rotate_keys is not None:
        k = rotate_keys(k, key_positions[:, :, :Tp])
    qg = q.reshape(S, H, G * Q, D)
    if causal and not variant and not return_key_scores and T == Q and Tp == T and bool((lengths == Q).all()):
        # first chunk of a sequence: the cache holds exactly these Q tokens in position order
        kp = key_positions[:, :, :T]
        if bool((kp == query_positions[:, None, :]).all()):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=G > 1)
            return out, None
    Dv = v.shape[-1]  # the values' width (MLA's latent: narrower than the keys)
    ragged = Tp != T or bool((lengths != T).any())
    mask = None  # [S, H, G*Q or 1, Tp] True = visible
    if causal:
        kp = key_positions[:, :, :Tp]
        vis = kp[:, :, None, :] <= query_positions[:, None, :, None]  # [S, H, Q, Tp]
        if window is not None:
            vis &= kp[:, :, None, :] > query_positions[:, None, :, None] - window
        if ragged:
            vis &= (torch.arange(Tp, device=q.device) < lengths.unsqueeze(-1))[:, :, None, :]
        mask = vis.unsqueeze(2).expand(S, H, G, Q, Tp).reshape(S, H, G * Q, Tp)
    elif ragged:
        mask = (torch.arange(Tp, device=q.device) < lengths.unsqueeze(-1))[:, :, None, :]
    if not variant and not return_key_scores and (causal or Q > 1):
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
        if causal:  # rows that see no key (only possible for padded queries) give NaN in SDPA
            out = torch.nan_to_num(out, nan=0.0)
        return out.reshape(S, Hq, Q, Dv), None  # SDPA with a mask may return a non-contiguous layout on CUDA
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [S, H, G*Q, Tp]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more logit per row (query head hq = h * G + g), dropped after the softmax
        sink = sinks.float().view(1, H, G, 1, 1).expand(S, H, G, Q, 1).reshape(S, H, G * Q, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if causal:
        probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs.to(v.dtype), v).reshape(S, Hq, Q, Dv)
    key_scores = probs.sum(dim=2)[:, :, :T] if return_key_scores else None
    return out, key_scores



def paged_decode_torch(
    q: torch.Tensor,  # [S, Hq, 1, D]
    k_pool: torch.Tensor,  # [num_blocks, bs, D]
    v_pool: torch.Tensor,
    tables: torch.Tensor,  # [S, H, MB] int32
    lengths: torch.Tensor,  # [S, H]
    scale: float,
    *,
    return_key_scores: bool = False,
    rotate_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    key_positions: torch.Tensor | None = None,  # [S, H, MB*bs] (for rotate_keys)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode attention (one query per sequence, every cached key visible) without a host sync: every block of the
    tables' width MB is read and slots past a table's length are masked, so no shape depends on the lengths'
    values (a CUDA graph can capture it). Returns (out [S, Hq, 1, D], key_scores [S, H, MB*bs] or None; 0 past
    each length). A table of length 0 gives zeros."""
    S, Hq, _, D = q.shape
    H, MB = tables.shape[1], tables.shape[2]
    G = Hq // H
    bs = k_pool.shape[1]
    Tp = MB * bs
    k = gather_blocks(k_pool, tables, MB)  # [S, H, Tp, D]
    v = gather_blocks(v_pool, tables, MB)
    if rotate_keys is not None:
        k = rotate_keys(k, key_positions[:, :, :Tp])
    valid = torch.arange(Tp, device=q.device) < lengths.unsqueeze(-1)  # [S, H, Tp]
    qg = q.reshape(S, H, G, D)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [S, H, G, Tp]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # empty tables: zeros
    out = torch.matmul(probs.to(v.dtype), v).reshape(S, Hq, 1, v.shape[-1])
    return out, (probs.sum(dim=2) if return_key_scores else None)
