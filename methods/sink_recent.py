"""`sink_recent`: StreamingLLM's token set as a plain scorer (kvpress `StreamingLLMPress`, a ScorerPress), so the
wrappers can take it as their base: the registry's decoding_streaming_llm (`decoding` over it) and
cam_streaming_llm (`merge` with decode=cam over it; CaM was introduced over StreamingLLM's eviction).

Score of a cached token: +inf for the first `n_sink` positions, else its position (newer = higher), so a table's
top-n holds the sinks and the n - n_sink most recent tokens: kvpress's score (ones, zeros on the n_pruned tokens
after the sinks) ranks the same set at every ratio. `streaming_llm` is the paper's own method (the window slides
while decoding, block by block; position re-indexing); this one only ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("sink_recent")
@dataclass
class SinkRecent(ScorerMethod):
    """The first n_sink tokens, then the most recent (kvpress StreamingLLMPress as a scorer)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    n_sink: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "n_sink", self.n_sink, 0)

    def score(self, obs: Observation) -> torch.Tensor:
        pos = obs.positions[:, : obs.keys.shape[1]]  # [H, T] original positions
        return pos.float().masked_fill(pos < self.n_sink, float("inf"))
