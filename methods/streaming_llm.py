"""`streaming_llm`: attention sinks plus a recent window (Xiao et al., ICLR 2024).

Keeps the first `sinks` tokens and the most recent `budget - sinks` tokens of every layer and
kv-head. Prefill evicts tokens down to the budget (after every chunk by default: StreamingLLM
processes text as a stream). While decoding (decode="window", the paper), whole blocks leave once every
token in them has fallen out of the window: when the table reaches budget + block_size, the oldest
block_size window tokens go through the cache's `drop_slots` (one block returns to the pool; if the sinks
end inside a block, the cache moves at most one block's survivors). decode="none" keeps every generated token.

position_mode="original": every key keeps its token position (RoPE applied at write time).
position_mode="reindex": the official code's behaviour: keys are cached before RoPE and rotated at
their index inside the cache (0..len-1), the query at its own index, so positions never exceed the
cache length.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import Method, register_method
from kvbench.methods.checks import check_choice, check_int
from kvbench.methods.eviction import EvictionMethod
from kvbench.runtime.contract import Observation

POSITION_MODES = ("original", "reindex")


@register_method("streaming_llm")
@dataclass
class StreamingLLM(EvictionMethod, Method):
    """Attention sinks + recent window; budget = sinks + window."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    granularity: ClassVar[str] = "block"
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("window", "none")
    decode_reads_attention: ClassVar[bool] = False  # evicts by position
    decode: str = "window"
    prefill_mode: str = "streaming"
    sinks: int = 4
    position_mode: str = "original"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sinks", self.sinks, 0)
        check_choice(self.name, "position_mode", self.position_mode, POSITION_MODES)
        if self.budget is not None and self.budget <= self.sinks:
            raise UserError(f"invalid budget {self.budget} for streaming_llm with sinks={self.sinks}: "
                            "the budget must exceed sinks (budget = sinks + window)")

    def window(self, budget: int | None) -> int | None:
        """The recent window under `budget` (None: per sequence, a compression_ratio)."""
        return None if budget is None else budget - self.sinks

    def min_budget(self) -> int:
        return self.sinks + 1

    @property
    def store_pre_rope(self) -> bool:
        return self.position_mode == "reindex"

    @property
    def rope_mode(self) -> str:
        return "cache" if self.position_mode == "reindex" else "original"

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["window"] = self.window(self.budget)
        return d

    # ------------------------------------------------------------------ eviction
    def keep_set(self, lengths: torch.Tensor, budget: int | None = None) -> torch.Tensor:
        """Sinks plus the last `window` slots of each head -> keep [H, <=budget] (sorted, -1 pads; by default the
        configured budget)."""
        budget = self.budget if budget is None else budget
        window = self.window(budget)
        H = lengths.shape[0]
        n = int(lengths.max())
        k = min(n, budget)
        keep = torch.full((H, k), -1, dtype=torch.int64, device=lengths.device)
        for h in range(H):
            L = int(lengths[h])
            if L <= budget:
                idx = torch.arange(L, device=lengths.device)
            else:
                idx = torch.cat([torch.arange(self.sinks, device=lengths.device),
                                 torch.arange(L - window, L, device=lengths.device)])
            keep[h, : idx.numel()] = idx
        return keep

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.lengths
        if int(lengths.max()) > budget:
            self.keep(obs, self.keep_set(lengths, budget))

    def evict_decode(self, obs: Observation, budget: int) -> None:
        bs = obs.block_size
        lengths = obs.table_lengths()
        n = max(lengths)
        if n < budget + bs:  # at most the filling block over the budget
            return
        if min(lengths) == n and n == budget + bs:
            # the oldest block_size window tokens leave: one block's worth of slots (the cache frees a block)
            obs.cache.drop_slots(obs.layer, obs.slot, self.sinks, self.sinks + bs)
            obs.refresh()
            return
        self.evict_prefill(obs, budget)  # fallback: token-level, down to the budget
