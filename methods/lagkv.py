"""`lagkv`: LagKV (Liang et al., 2025, arXiv 2504.04704; kvpress `LagKVPress`), attention-free lag-relative scores.

The table (after the first `n_sink` tokens) is cut into partitions of `lag_size` tokens; each partition is scored
against the *next* one (its lag reference): per channel, K and V are min-max normalised with the reference's min and
max, a token's score is the standard deviation of its normalised vector over channels, softmaxed within the
partition, and K's and V's scores are averaged. Without `cross_scoring` (default) a token's score is its rank inside
its partition / lag_size, so every partition keeps about the same share. The sinks and the last partition (plus the
remainder that does not fill one) have no reference and score 1 (kept first). A table shorter than
n_sink + 2 * lag_size has no complete scored partition: the sinks then score 1 and the rest rises linearly with the
position, so the newest tokens are kept (kvpress's fallback). Each kv-head keeps its `budget` best (per kv-head
scores, keys as cached, post-RoPE, as kvpress). Defaults are kvpress's: n_sink 4, lag_size 128; the prompt is
compressed once after prefill (decode="none"; the paper also re-compresses while decoding).
One deliberate difference: a channel whose reference is constant (max = min) normalises to 0, where kvpress divides
by zero (NaN).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


def lag_relative_scores(x: torch.Tensor, lag: int) -> torch.Tensor:
    """x [H, P, lag, D] (P partitions) -> [H, P-1, lag]: partition p normalised by partition p+1's per-channel
    min/max, std over channels, softmax within the partition."""
    ref, cur = x[:, 1:], x[:, :-1]
    lo = ref.min(dim=-2, keepdim=True).values  # [H, P-1, 1, D]
    span = ref.max(dim=-2, keepdim=True).values - lo
    span = torch.where(span == 0, torch.ones_like(span), span)
    return ((cur - lo) / span).std(dim=-1).softmax(dim=-1)


def lagkv_scores(k: torch.Tensor, v: torch.Tensor, n_sink: int, lag: int, cross_scoring: bool) -> torch.Tensor:
    """k, v [H, T, D] -> LagKV scores [H, T] (higher = keep), kvpress's definition."""
    H, T, D = k.shape
    if T < n_sink + 2 * lag:  # no complete partition with a reference: sinks, then the newest tokens
        s = torch.ones(H, T, dtype=torch.float32, device=k.device)
        if T > n_sink:
            s[:, n_sink:] = torch.arange(T - n_sink, device=k.device) / (T - n_sink)
        return s
    end = n_sink + ((T - n_sink) // lag) * lag
    kp = k[:, n_sink:end].float().reshape(H, -1, lag, D)  # [H, P, lag, D]
    vp = v[:, n_sink:end].float().reshape(H, -1, lag, D)
    s = (lag_relative_scores(kp, lag) + lag_relative_scores(vp, lag)) / 2  # [H, P-1, lag] in [0, 1]
    if not cross_scoring:
        s = s.argsort(dim=-1).argsort(dim=-1).float() / lag  # rank within the partition
    sinks = s.new_ones(H, n_sink)
    tail = s.new_ones(H, lag + T - end)  # the last partition and the remainder: no reference
    return torch.cat([sinks, s.reshape(H, -1), tail], dim=-1)


@register_method("lagkv")
@dataclass
class LagKV(ScorerMethod):
    """Lag-relative min-max normalised K/V spread, ranked within partitions; sinks and the tail kept."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    n_sink: int = 4
    lag_size: int = 128
    cross_scoring: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_int(self.name, "lag_size", self.lag_size, 1)
        check_bool(self.name, "cross_scoring", self.cross_scoring)

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.pre_rope:
            raise UserError(f"method {self.name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        return lagkv_scores(obs.keys, obs.values, self.n_sink, self.lag_size, self.cross_scoring)
