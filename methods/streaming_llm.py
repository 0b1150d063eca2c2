"""`streaming_llm`: attention sinks plus a recent window (Xiao et al., ICLR 2024).

Keeps the first `sinks` tokens and the most recent `budget - sinks` tokens of every layer and
kv-head. Prefill evicts tokens down to the budget (after every chunk by default: StreamingLLM
processes text as a stream). While decoding, whole blocks leave once every token in them has fallen
out of the window: when the table reaches budget + block_size, the oldest block_size window tokens
go. If the sinks end inside a block (sinks % block_size != 0), that block is shared by the sinks and
the oldest window tokens: the survivors of the next block move into it (block_size - sinks % bs
tokens) and the next block is returned to the pool; nothing else moves.

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
from kvbench.runtime.kv_cache import PagedKVCache
from kvbench.runtime.model import LayerContext
from methods._selection import EvictionMethod, check_choice, check_int
from methods.base import register_method

POSITION_MODES = ("original", "reindex")


@register_method("streaming_llm")
@dataclass
class StreamingLLM(EvictionMethod):
    """Attention sinks + recent window; budget = sinks + window."""

    granularity: ClassVar[str] = "block"
    prefill_mode: str = "streaming"
    sinks: int = 4
    position_mode: str = "original"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sinks", self.sinks, 0)
        check_choice(self.name, "position_mode", self.position_mode, POSITION_MODES)
        if self.budget <= self.sinks:
            raise UserError(f"invalid budget {self.budget} for streaming_llm with sinks={self.sinks}: "
                            "the budget must exceed sinks (budget = sinks + window)")

    @property
    def window(self) -> int:
        return self.budget - self.sinks

    @property
    def store_pre_rope(self) -> bool:
        return self.position_mode == "reindex"

    @property
    def rope_mode(self) -> str:
        return "cache" if self.position_mode == "reindex" else "original"

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["window"] = self.window
        return d

    # ------------------------------------------------------------------ eviction
    def keep_set(self, lengths: torch.Tensor) -> torch.Tensor:
        """Sinks plus the last `window` slots of each head -> keep [H, <=budget] (sorted, -1 pads)."""
        H = lengths.shape[0]
        n = int(lengths.max())
        k = min(n, self.budget)
        keep = torch.full((H, k), -1, dtype=torch.int64, device=lengths.device)
        for h in range(H):
            L = int(lengths[h])
            if L <= self.budget:
                idx = torch.arange(L, device=lengths.device)
            else:
                idx = torch.cat([torch.arange(self.sinks, device=lengths.device),
                                 torch.arange(L - self.window, L, device=lengths.device)])
            keep[h, : idx.numel()] = idx
        return keep

    def evict_prefill(self, ctx: LayerContext, i: int, slot: int) -> None:
        lengths = ctx.cache.lengths[slot, ctx.layer]
        if int(lengths.max()) > self.budget:
            self.keep(ctx, slot, self.keep_set(lengths))

    def evict_decode(self, ctx: LayerContext, i: int, slot: int) -> None:
        cache, bs = ctx.cache, ctx.cache.block_size
        lengths = cache.lengths[slot, ctx.layer]
        n = int(lengths.max())
        if n < self.budget + bs:  # at most the filling block over the budget
            return
        uniform = int(lengths.min()) == n
        if uniform and n == self.budget + bs and self._drop_oldest_window_block(cache, ctx.layer, slot, n):
            return
        self.evict_prefill(ctx, i, slot)  # fallback: token-level, down to the budget

    def _drop_oldest_window_block(self, cache: PagedKVCache, layer: int, slot: int, n: int) -> bool:
        """Evict window slots sinks..sinks+bs-1 of every head by dropping one whole block.

        Returns False (nothing changed) where that cannot be done without moving more than one block's
        tokens: a storage codec with its own layout, a shared block, or a window shorter than a block."""
        bs = cache.block_size
        a, r = divmod(self.sinks, bs)
        if r == 0:
            for h in range(cache.num_kv_heads):
                cache.evict_blocks(layer, slot, h, [a])
            return True
        if type(cache) is not PagedKVCache or n < (a + 2) * bs:
            return False
        table = cache.tables[slot, layer]  # [H, MB]
        dst = table[:, a].to(torch.int64)  # block shared by the last sinks and the oldest window tokens
        src = table[:, a + 1].to(torch.int64)  # the next block; its first r slots are the rest of the evicted
        if any(cache.pool.refcount(int(b)) > 1 for b in dst):
            return False
        cache.k_pool[dst, r:] = cache.k_pool[src, r:]
        cache.v_pool[dst, r:] = cache.v_pool[src, r:]
        pos = cache.positions[slot, layer]  # [H, MB*bs]
        pos[:, a * bs + r: (a + 1) * bs] = pos[:, (a + 1) * bs + r: (a + 2) * bs].clone()
        for h in range(cache.num_kv_heads):
            cache.evict_blocks(layer, slot, h, [a + 1])
        return True
