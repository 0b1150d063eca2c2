"""What a method observes: the statistics a scorer declares and the driver keeps per (sequence, layer), and the
attention-based scores built on them.

Declared observations (methods.eviction.EvictionMethod gathers them before a scorer runs):
  query_window > 0          the last `query_window` queries [Hq, W, D] and their positions [W], carried across
                            prefill chunks (SnapKV's observation window, TOVA's newest query): obs.queries
  accumulates_attention     the attention mass each cached token has received, summed over every query so far and
                            over each kv-head's query heads [H, T] (H2O): obs.attention; the runtime returns it
                            per step (the hook protocol's needs_key_scores), no attention matrix is kept
Both live in the per-(sequence, layer) state ("q", "q_pos", "scores"), realigned with the cache on every eviction.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.runtime.contract import Observation
from kvbench.methods.selection import valid_mask

POOLINGS = ("avgpool", "maxpool")


def push_queries(state: dict[str, Any], obs: Observation, window: int) -> None:
    """Keep the last `window` queries [Hq, W, D] of the sequence and their positions [W] in state["q"/"q_pos"]."""
    q, pos = obs.step_queries, obs.step_query_positions  # [Hq, Q, D], [Q]
    if "q" in state:
        q = torch.cat([state["q"], q], dim=1)
        pos = torch.cat([state["q_pos"], pos])
    state["q"], state["q_pos"] = q[:, -window:].clone(), pos[-window:].clone()


def accumulate_attention(state: dict[str, Any], obs: Observation, name: str) -> None:
    """H2O statistics: add this step's attention mass per key slot to state["scores"] [H, T]."""
    if obs.key_scores is None:
        raise RuntimeError(f"{name}: the runtime gave no key_scores (needs_key_scores is set)")
    n = max(obs.table_lengths())  # observed before this layer evicts: still exact
    ks = obs.key_scores[:, :n].float()  # [H, n]
    acc = state.get("scores")
    if acc is None:
        acc = torch.zeros_like(ks)
    elif acc.shape[-1] < n:
        acc = F.pad(acc, (0, n - acc.shape[-1]))
    state["scores"] = acc + ks


def window_attention_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass each key receives from a window of queries, summed per kv-head (SnapKV).

    q [Hq, W, D] (as used by attention), q_pos [W]; k [H, T, D] (post-RoPE, as cached), k_pos [H, T];
    lengths [H]. Softmax over the cached keys a query may see (causal by original position); the
    probabilities are summed over the window and over the query heads of each kv-head -> [H, T].
    """
    Hq, W, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    qg = q.reshape(H, G * W, D).to(k.dtype)
    logits = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [H, G*W, T]
    qp = q_pos.repeat(G)  # [G*W] (query-head-major, like qg)
    vis = (k_pos[:, None, :] <= qp[None, :, None]) & valid_mask(lengths, T)[:, None, :]
    probs = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
    return torch.nan_to_num(probs, nan=0.0).sum(dim=1)  # [H, T]


POOLINGS = ("avgpool", "maxpool")


def pool_tokens(scores: torch.Tensor, kernel: int, pooling: str = "avgpool") -> torch.Tensor:
    """Pool [H, T] along tokens with an odd kernel, stride 1, same length (SnapKV's clustering).

    avgpool is the official code's default (F.avg_pool1d, zero padding counted, as in SnapKV and kvpress)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    return pool(scores[:, None, :], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0, :]




def snapkv_scores(obs: Observation, window: int, kernel: int, pooling: str, name: str) -> torch.Tensor:
    """SnapKV importance [H, T]: window-query attention summed over the window and the query heads of each
    kv-head, pooled over the tokens before the window (the window's own columns are +inf: always kept).
    Summing a GQA group before pooling ranks like averaging it; with avgpool the order of pooling and
    group aggregation does not matter, with maxpool the group is aggregated first."""
    if obs.pre_rope:
        raise UserError(f"method {name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
    k, k_pos = obs.keys, obs.positions  # [H, T, D], [H, T]
    T = k.shape[1]
    s = window_attention_scores(obs.queries, obs.query_positions, k, k_pos, obs.lengths, obs.head_dim ** -0.5)
    w = min(window, T)
    out = torch.full_like(s, float("inf"))
    out[:, : T - w] = pool_tokens(s[:, : T - w], kernel, pooling)
    return out
