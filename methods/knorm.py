"""`knorm`: keep the keys of smallest L2 norm (Devoto et al., 2024, arXiv 2406.11430; kvpress `KnormPress`).

Score of a cached token = -||k||_2 of its key as cached (post-RoPE; RoPE keeps norms), per kv-head; each kv-head
keeps its `budget` lowest-norm keys. As in kvpress, the prompt is compressed once after prefill (decode="none":
generated tokens are appended) and nothing is protected: no sinks, no recent window, not even the newest prompt
token (the base class would always keep the newest; kvpress does not).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.runtime.model import LayerContext
from kvbench.methods.base import register_method
from kvbench.methods.eviction import ScoreEvictionMethod, top_tokens


@register_method("knorm")
@dataclass
class KNorm(ScoreEvictionMethod):
    """Lowest key norms per kv-head; the prompt is compressed once."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    decode: str = "none"

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        k, _, _ = ctx.cache.gather(ctx.layer, slot)  # [H, T, D]
        return -k.float().norm(dim=-1)  # [H, T]

    def select(self, ctx: LayerContext, i: int, slot: int, lengths: torch.Tensor) -> torch.Tensor:
        return top_tokens(self.score(ctx, i, slot), self.budget, lengths)  # by score alone, as kvpress
