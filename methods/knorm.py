"""`knorm`: keep the keys of smallest L2 norm (Devoto et al., 2024, arXiv 2406.11430; kvpress `KnormPress`).

Score of a cached token = -||k||_2 of its key as cached (post-RoPE; RoPE keeps norms), per kv-head; each kv-head
keeps its `budget` lowest-norm keys. As in kvpress, the prompt is compressed once after prefill (decode="none":
generated tokens are appended) and nothing is protected: no sinks, no recent window, not even the newest prompt
token (methods/_kvpress.py). decode="evict" (the K-Norm decoding baseline of the reasoning studies) also evicts
the highest-norm keys after every decode step, keeping the newest token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.runtime.contract import LayerContext
from kvbench.methods._kvpress import KVPressScorer
from kvbench.methods.base import register_method


@register_method("knorm")
@dataclass
class KNorm(KVPressScorer):
    """Lowest key norms per kv-head; the prompt is compressed once (decode="evict": every step too)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        k, _, _ = ctx.cache.gather(ctx.layer, slot)  # [H, T, D]
        return -k.float().norm(dim=-1)  # [H, T]
