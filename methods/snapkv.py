"""`snapkv`: SnapKV (Li et al., 2024; official code FasterDecoding/SnapKV, `SnapKVCluster`).

Prompt compression: the last `window` prompt queries (the observation window) attend over every cached key;
their softmax probabilities are summed over the window and over the query heads of each kv-head, pooled along the
tokens before the window (`pooling` avgpool as in the official code and kvpress, or maxpool; kernel
`kernel_size`, stride 1, same length), and each kv-head keeps its top `budget - window` tokens plus the window.
The window's queries are carried across prefill chunks, so a short last chunk still scores with `window` queries.
GQA: the query heads of a group are summed (the same ranking as averaging); with avgpool, pooling before or
after that aggregation gives the same scores; with maxpool the group is aggregated first.

Decoding (`decode`):
  "none" (default, the paper and official code): the prompt is compressed once; generated tokens are appended.
  "window": the prompt selection stays, the newest `window` tokens slide; each step the token leaving the
      window is evicted, so the budget holds at every step.
  "rescore": every step re-runs the selection with the last `window` queries (decode queries included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice, check_int
from kvbench.methods.observers import POOLINGS, snapkv_scores
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@dataclass
class SnapKVScores:
    """SnapKV's options and scores (a mixin before ScorerMethod; PyramidKV shares it): the observation window's
    attention, pooled; the window itself always kept."""

    keeps_newest_at_prefill: ClassVar[bool] = True
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avgpool"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise UserError(f"invalid snapkv.kernel_size={self.kernel_size}: expected an odd integer >= 1")
        check_choice(self.name, "pooling", self.pooling, POOLINGS)

    @property
    def query_window(self) -> int:
        return self.window  # declared: obs.queries holds the last `window` queries

    def recent_window(self, budget: int) -> int:
        return min(self.window, budget)

    def score(self, obs: Observation) -> torch.Tensor:
        return snapkv_scores(obs, self.window, self.kernel_size, self.pooling, self.name)

    def score_scale(self, obs: Observation) -> float:
        """score() sums over the W window queries and the G query heads of a kv-head; kvpress's SnapKVPress
        averages both (the same ranking): 1 / (W x G)."""
        cfg = self.model_config
        W = obs.queries.shape[1]  # the window queries held: [Hq, W, D]
        return 1.0 / (W * (cfg.num_heads // cfg.num_kv_heads))


@register_method("snapkv")
@dataclass
class SnapKV(SnapKVScores, ScorerMethod):
    """Observation-window attention, pooled; keep top per kv-head plus the window."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "window", "rescore")
    decode: str = "none"

    def observes_in_decode(self) -> bool:
        return self.decode in ("rescore", "interval")  # re-scored from the latest queries

    def evict_decode(self, obs: Observation, budget: int) -> None:
        if self.decode == "rescore":
            return self.evict_to_budget(obs, budget)
        if max(obs.table_lengths()) <= budget:
            return
        lengths = obs.lengths  # [H]
        w = self.recent_window(budget)
        H = lengths.shape[0]
        keep = torch.full((H, budget), -1, dtype=torch.int64, device=lengths.device)
        for h in range(H):  # the selected tokens, then the last w (the window slides by one)
            L = int(lengths[h])
            idx = torch.arange(L, device=lengths.device) if L <= budget else torch.cat([
                torch.arange(budget - w, device=lengths.device),
                torch.arange(L - w, L, device=lengths.device)])
            keep[h, : idx.numel()] = idx
        self.keep(obs, keep)
