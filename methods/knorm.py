"""`knorm`: keep the keys of smallest L2 norm (Devoto et al., 2024, arXiv 2406.11430; kvpress `KnormPress`).

Score of a cached token = -||k||_2 of its key as cached (post-RoPE; RoPE keeps norms), per kv-head; each kv-head
keeps its `budget` lowest-norm keys. As in kvpress, the prompt is compressed once after prefill (decode="none":
generated tokens are appended) and nothing is protected: no sinks, no recent window, not even the newest prompt
token (methods/scorer.py, ScorerMethod's defaults). decode="evict" (the K-Norm decoding baseline of the reasoning studies) also evicts
the highest-norm keys after every decode step, keeping the newest token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.methods.base import register_method
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("knorm")
@dataclass
class KNorm(ScorerMethod):
    """Lowest key norms per kv-head; the prompt is compressed once (decode="evict": every step too)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)  # keys [H, T, D] -> [H, T]
