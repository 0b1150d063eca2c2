"""`observed_attention`: the attention each key received, averaged over the queries that saw it (kvpress
`ObservedAttentionPress`, related to H2O, arXiv 2306.14048).

Score of a cached token = the attention probability it has received, summed over every query so far (the prompt's
rows, and each decode step with decode="evict") and over its kv-head's query heads, divided by the number of those
queries: tokens_seen - its position (a causal key at position p is seen by the queries at p, ..., tokens_seen - 1).
kvpress divides the prompt's attention sum by the same count (n_tokens, n_tokens - 1, ..., 1) and averages a GQA
group where kvbench sums it: a constant factor per kv-head, the same ranking. As in kvpress, the prompt is
compressed once by score alone (no sinks, no window; ScorerMethod's defaults). Scores come from the runtime as
per-key sums (`needs_key_scores`), as H2O's: no attention matrix is kept (kvpress needs eager attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.methods.base import register_method
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("observed_attention")
@dataclass
class ObservedAttention(ScorerMethod):
    """Mean attention per observing query, per kv-head; the prompt compressed once (decode="evict": every step)."""

    accumulates_attention: ClassVar[bool] = True  # declared: obs.attention [H, T]
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")

    def score(self, obs: Observation) -> torch.Tensor:
        acc = obs.attention  # [H, T] attention summed over the queries so far and the group's query heads
        seen_by = (obs.tokens_seen - obs.positions[:, : acc.shape[-1]]).clamp(min=1)  # [H, T] queries per key
        return acc / seen_by.to(acc.dtype)
