"""`cur`: CurDKV (arXiv 2509.15038; kvpress `CURPress`): approximate leverage of the keys and values.

Per kv-head, k2 = ||k_t||^2 and v2 = ||v_t||^2 (with `use_random_leverage`, of the keys and values projected by a
Gaussian G [D, 20] / sqrt(20) drawn from `seed`); with `use_local_approximation` (default) each is normalised within
consecutive windows of `local_window_size` tokens (the table zero-padded to a multiple of the window, as kvpress);
score = k2 * v2 (`leverage_type` kv_product, default), k2 (key), v2 (value) or (k2 + v2) / 2 (kv_avg), normalised
to sum 1 over the head's tokens; the first `num_sinks` tokens score 1.0 (attention sinks). Key norms do not change
under RoPE, so pre- and post-RoPE caches score alike. Each kv-head keeps its top tokens by score alone (kvpress's
ScorerPress); the prompt is compressed once after prefill (decode="none"); decode="evict" re-selects every step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_choice, check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation

LEVERAGE_TYPES = ("kv_product", "key", "value", "kv_avg")


def local_normalise(x: torch.Tensor, w: int) -> torch.Tensor:
    """x [H, T] divided by its sum within consecutive windows of w tokens (zero-padded to a multiple of w)."""
    H, T = x.shape
    xp = F.pad(x, (0, (w - T % w) % w)).reshape(H, -1, w)
    return (xp / xp.sum(dim=-1, keepdim=True)).reshape(H, -1)[:, :T]


def cur_scores(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, num_sinks: int, leverage_type: str,
               local_window: Optional[int], projection: Optional[torch.Tensor] = None) -> torch.Tensor:
    """CurDKV's score [H, T] of k, v [H, T, D] (slots >= lengths[h] ignored; they score 0)."""
    H, T, _ = k.shape
    valid = torch.arange(T, device=k.device)[None, :] < lengths[:, None]
    k, v = k.float(), v.float()
    if projection is not None:
        k, v = k @ projection, v @ projection
    k2 = (k ** 2).sum(-1) * valid
    v2 = (v ** 2).sum(-1) * valid
    if local_window is not None:
        k2 = torch.nan_to_num(local_normalise(k2, local_window)) * valid
        v2 = torch.nan_to_num(local_normalise(v2, local_window)) * valid
    s = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[leverage_type]
    s = s / s.sum(dim=-1, keepdim=True)
    s[:, :num_sinks] = 1.0
    return s


@register_method("cur")
@dataclass
class CUR(ScorerMethod):
    """Key x value approximate leverage, normalised in local windows; sinks kept."""

    num_sinks: int = 4
    leverage_type: str = "kv_product"
    use_random_leverage: bool = False
    use_local_approximation: bool = True
    local_window_size: int = 16
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "num_sinks", self.num_sinks, 0)
        check_choice(self.name, "leverage_type", self.leverage_type, LEVERAGE_TYPES)
        check_bool(self.name, "use_random_leverage", self.use_random_leverage)
        check_bool(self.name, "use_local_approximation", self.use_local_approximation)
        check_int(self.name, "local_window_size", self.local_window_size, 1)

    def projection(self, D: int, device) -> Optional[torch.Tensor]:
        if not self.use_random_leverage:
            return None
        g = torch.Generator().manual_seed(0 if self.seed is None else int(self.seed))
        return (torch.randn(D, 20, generator=g) / math.sqrt(20)).to(device)

    def score(self, obs: Observation) -> torch.Tensor:
        k = obs.keys
        return cur_scores(k, obs.values, obs.lengths, num_sinks=self.num_sinks, leverage_type=self.leverage_type,
                          local_window=self.local_window_size if self.use_local_approximation else None,
                          projection=self.projection(k.shape[-1], k.device))
