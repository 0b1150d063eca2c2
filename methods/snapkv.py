"""`snapkv`: SnapKV (Li et al., 2024), a baseline of the PagedEviction and KVCrush papers.

Prompt compression: the last `window` prompt queries (the observation window) attend over every
cached key; their softmax probabilities are summed over the window and over the query heads of each
kv-head, max-pooled along the tokens (kernel `kernel_size`, pooling over the tokens before the
window only), and each kv-head keeps its top `budget - window` tokens plus the window itself.
The window's queries are carried across prefill chunks, so a short last chunk still scores with
`window` queries.

Decoding (SnapKV itself does not compress there; kvbench holds the budget at every step):
  decode_mode="window" (default): the prompt selection stays; the most recent `window` tokens form a
      sliding window; each step the token leaving it is evicted. No scoring while decoding.
  decode_mode="rescore": every step re-runs the SnapKV selection with the last `window` queries
      (decode queries included) over the current cache; costs one window-attention per layer and step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.errors import UserError
from kvbench.runtime.model import LayerContext
from methods._selection import ScoreEvictionMethod, check_choice, check_int
from methods.base import register_method

DECODE_MODES = ("window", "rescore")


@register_method("snapkv")
@dataclass
class SnapKV(ScoreEvictionMethod):
    """Observation-window attention, max-pooled; keep top per kv-head plus the window."""

    window: int = 32
    kernel_size: int = 7
    decode_mode: str = "window"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise UserError(f"invalid snapkv.kernel_size={self.kernel_size}: expected an odd integer >= 1")
        check_choice(self.name, "decode_mode", self.decode_mode, DECODE_MODES)

    def recent_window(self) -> int:
        return min(self.window, self.budget)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["pooling"] = "max"
        return d

    def observe(self, ctx: LayerContext, i: int, slot: int) -> None:
        if ctx.phase == "prefill" or self.decode_mode == "rescore":
            self.push_queries(ctx, i, slot, self.window)

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        return self.snapkv_scores(ctx, slot, self.window, self.kernel_size)

    def evict_decode(self, ctx: LayerContext, i: int, slot: int) -> None:
        if self.decode_mode == "rescore":
            return self.evict_to_budget(ctx, i, slot)
        lengths = ctx.cache.lengths[slot, ctx.layer]  # [H]
        if int(lengths.max()) <= self.budget:
            return
        w = self.recent_window()
        H = lengths.shape[0]
        keep = torch.full((H, self.budget), -1, dtype=torch.int64, device=lengths.device)
        for h in range(H):  # the selected tokens, then the last w (the window slides by one)
            L = int(lengths[h])
            idx = torch.arange(L, device=lengths.device) if L <= self.budget else torch.cat([
                torch.arange(self.budget - w, device=lengths.device),
                torch.arange(L - w, L, device=lengths.device)])
            keep[h, : idx.numel()] = idx
        self.keep(ctx, slot, keep)
