"""Shared base of the methods ported from kvpress's scorer presses (random, knorm, expected_attention, lagkv).

A kvpress `ScorerPress` compresses the prompt once, keeping each kv-head's `n_kept` best-scoring tokens by score
alone: no recent window, and the newest prompt token only if it scores high enough. `KVPressScorer` does the same
at prefill (`evict_prefill`), while `select`, the base class's selection (which always keeps the newest token, for
decode-time eviction), is left as it is so these methods stay plain scorers that a wrapper (adakv) can take as
its base. Whatever a method must always keep (expected_attention's sinks) it scores +inf, as kvpress pads them
with the highest score. (The module name starts with "_": the method registry does not load it as a method.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.runtime.contract import LayerContext
from kvbench.methods.eviction import ScoreEvictionMethod, top_tokens


@dataclass
class KVPressScorer(ScoreEvictionMethod):
    """Prompt-time eviction by score alone (kvpress's ScorerPress.compress); generated tokens are appended."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    decode: str = "none"

    def evict_prefill(self, ctx: LayerContext, i: int, slot: int) -> None:
        lengths = ctx.cache.lengths[slot, ctx.layer]  # [H]
        if int(lengths.max()) > self.budget:
            self.keep(ctx, slot, top_tokens(self.score(ctx, i, slot), self.budget, lengths))
