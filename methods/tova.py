"""`tova`: Token Omission Via Attention (Oren et al., 2024, arXiv 2401.06104; official code
schwartz-lab-NLP/TOVA `tova_cache.py`; kvpress `TOVAPress`).

Score of a cached token = the attention probability the newest query gives it (softmax over every cached key the
query sees, itself included), averaged over the query heads. heads="shared" (default, the official code and
kvpress): averaged over *all* query heads of the layer, so every kv-head of the layer keeps the same tokens;
heads="per_head": averaged over the query heads of each kv-head's GQA group only. Each table keeps its `budget`
best tokens; the newest token always stays (kvpress pads it with the highest score; its own attention is
usually the largest anyway).

When (`decode`):
  "none" (default, kvpress's leaderboard): the prompt is compressed once with the last prompt token's attention;
      generated tokens are appended.
  "evict" (the paper and the official TOVA code): in addition, after every decode step the table drops back to
      the budget by the new token's attention, so the cache never holds more than `budget` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice
from kvbench.methods.eviction import HEAD_MODES
from kvbench.methods.observers import window_attention_scores
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("tova")
@dataclass
class TOVA(ScorerMethod):
    """The newest query's attention, averaged over heads; keep the top tokens."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    keeps_newest_at_prefill: ClassVar[bool] = True
    query_window: ClassVar[int] = 1  # declared: obs.queries holds the newest query [Hq, 1, D]
    decode: str = "none"
    heads: str = "shared"

    def tensor_parallel_refusal(self) -> str | None:
        if self.heads == "shared":
            return ("heads=shared averages the attention of every query head of a layer, which a kv-head shard does "
                    "not hold (use tova.heads=per_head)")
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "heads", self.heads, HEAD_MODES)

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.pre_rope:
            raise UserError(f"method {self.name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        # probabilities summed over each kv-head's query heads: the group mean up to a constant factor
        s = window_attention_scores(obs.queries, obs.query_positions, obs.keys, obs.positions, obs.lengths,
                                    obs.head_dim ** -0.5)  # [H, T]
        if self.heads == "shared":
            s = s.sum(dim=0, keepdim=True).expand_as(s)  # every query head of the layer
        return s
