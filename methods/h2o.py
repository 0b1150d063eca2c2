"""`h2o`: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Each kv-head's score for a cached token is the attention probability it has received, summed over
the query heads of the kv-head's group and accumulated over every query seen so far (all prompt rows
and every decode step). The budget is split into the last `round(recent_ratio * budget)` tokens and
the heavy hitters: the highest accumulated scores among the older tokens; the newest token always stays
(with recent_ratio=0 a generated token would otherwise be evicted right after its own step). Eviction runs
after the prompt (or after every chunk with prefill_mode=streaming) and, with decode="evict" (default, the
paper), after every decode step, so the cache never holds more than `budget` tokens after a step;
decode="none" compresses the prompt only. Scores come from the runtime as per-key sums
(`needs_key_scores`); no attention matrix is kept, and the scores follow the tokens when the table is
compacted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_float
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("h2o")
@dataclass
class H2O(ScorerMethod):
    """Heavy hitters (accumulated attention) plus a recent window, per kv-head."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    accumulates_attention: ClassVar[bool] = True  # declared: obs.attention
    keeps_newest_at_prefill: ClassVar[bool] = True
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("evict", "none")
    decode: str = "evict"
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self.name, "recent_ratio", self.recent_ratio, 0.0, 1.0)

    def recent_window(self, budget: int) -> int:
        return int(round(budget * self.recent_ratio))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        per_sequence = self.budget is None  # compression_ratio: the split is made per sequence
        d["recent_tokens"] = None if per_sequence else self.recent_window(self.budget)
        d["heavy_tokens"] = None if per_sequence else self.budget - self.recent_window(self.budget)
        return d

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.attention  # [H, T] accumulated attention
