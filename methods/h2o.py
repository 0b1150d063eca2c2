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

from kvbench.runtime.contract import LayerContext
from kvbench.methods.eviction import ScoreEvictionMethod, check_float
from kvbench.methods.base import register_method


@register_method("h2o")
@dataclass
class H2O(ScoreEvictionMethod):
    """Heavy hitters (accumulated attention) plus a recent window, per kv-head."""

    needs_key_scores: ClassVar[bool] = True
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self.name, "recent_ratio", self.recent_ratio, 0.0, 1.0)

    def recent_window(self) -> int:
        return int(round(self.budget * self.recent_ratio))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        per_sequence = self.budget is None  # compression_ratio: the split is made per sequence
        d["recent_tokens"] = None if per_sequence else self.recent_window()
        d["heavy_tokens"] = None if per_sequence else self.budget - self.recent_window()
        return d

    def observe(self, ctx: LayerContext, i: int, slot: int) -> None:
        self.accumulate_key_scores(ctx, i, slot)

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        return self.state(slot, ctx.layer)["scores"]  # [H, T] accumulated attention
