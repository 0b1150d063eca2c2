"""`kvcrush`: KVCrush (arXiv 2503.00022): important tokens plus representatives of the evicted ones.

The budget is split: `budget - round(r * budget)` tokens go to the most important tokens of each
kv-head by an importance method, `round(r * budget)` to representatives chosen from the tokens that
importance alone would evict:
  1. importance: "h2o" (accumulated attention, recent share `recent_ratio` of the important part
     kept first) or "snapkv" (observation-window attention of the last `window` queries, max-pooled
     with `kernel_size` and `pooling`; the window kept first);
  2. signature: every token gets one bit per kv-head of the layer: 1 if the token is in the top half
     of that head's importance scores (the H bits are shared by all heads);
  3. each head orders its would-be-evicted tokens by Hamming distance between their signature and an
     anchor signature ("random": fixed random bits per layer from `seed`; "zeros"; "ones"; "mean":
     per head, the majority bit of its candidates), ties by position;
  4. it keeps evenly spaced picks along that order: candidates[floor(j * m / n_rep)], j < n_rep, of m.
Decoding (`decode="rescore"`, default) re-runs the whole selection every step (the budget holds after each
step), as its H2O importance does; with importance="snapkv" the window then holds the last decode queries.
`decode="none"` compresses the prompt only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice, check_float, check_int
from kvbench.methods.observers import POOLINGS, snapkv_scores
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.selection import sort_keep, top_tokens, valid_mask
from kvbench.runtime.contract import Observation

IMPORTANCE = ("h2o", "snapkv")
ANCHORS = ("random", "zeros", "ones", "mean")


def top_half_bits(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """scores [H, T] -> signature bits [H, T] bool: token in the top half (floor(n/2)) of its head."""
    H, T = scores.shape
    valid = valid_mask(lengths, T)
    s = scores.float().masked_fill(~valid, float("-inf"))
    half = lengths // 2  # [H]
    k = int(half.max())
    bits = torch.zeros(H, T, dtype=torch.bool, device=scores.device)
    if k:
        idx = s.topk(k, dim=-1).indices  # [H, k], best first
        take = torch.arange(k, device=scores.device)[None, :] < half[:, None]
        bits.scatter_(-1, idx, take)
    return bits


def hamming_order(candidates: torch.Tensor, signatures: torch.Tensor,
                  anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each selecting head sorted by Hamming distance to its anchor (ties: slot order).

    candidates [H, T] bool; signatures [B, T] bool (B signature bits per token); anchor [H, B] bool.
    Returns (order [H, T] slot indices, candidates first; m [H] number of candidates)."""
    H, T = candidates.shape
    dist = (signatures.T[None, :, :] != anchor[:, None, :]).sum(-1)  # [H, T]
    key = dist * T + torch.arange(T, device=dist.device)[None, :]
    key = key.masked_fill(~candidates, (signatures.shape[0] + 1) * T)
    return key.argsort(dim=-1, stable=True), candidates.sum(-1)


def spread_picks(order: torch.Tensor, m: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Evenly spaced picks order[h, floor(j * m_h / n_rep)], j < n_rep -> [H, n_rep] slot indices.

    A head with m_h <= n_rep candidates keeps all of them (-1 pads the rest)."""
    j = torch.arange(n_rep, device=order.device)[None, :]
    col = (j * m[:, None]) // n_rep  # [H, n_rep]
    col = torch.where(m[:, None] <= n_rep, j, col)
    picks = order.gather(-1, col.clamp(max=order.shape[1] - 1))
    return torch.where(j < m[:, None], picks, torch.full_like(picks, -1))


@register_method("kvcrush")
@dataclass
class KVCrush(ScorerMethod):
    """Importance top-(1-r) plus r representatives spread over the Hamming-distance order."""

    r: float = 0.25
    importance: str = "h2o"
    anchor: str = "random"
    seed: int | None = None  # None: the run's top-level seed (build_method passes it), else 0
    recent_ratio: float = 0.5
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avgpool"
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("rescore", "none")
    keeps_newest_at_prefill: ClassVar[bool] = True
    decode: str = "rescore"

    def tensor_parallel_refusal(self) -> str | None:
        return "its token signatures take one bit from every kv-head of a layer, which a kv-head shard does not hold"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self.name, "r", self.r, 0.0, 1.0)
        check_choice(self.name, "importance", self.importance, IMPORTANCE)
        check_choice(self.name, "anchor", self.anchor, ANCHORS)
        if self.seed is None:
            self.seed = 0
        check_int(self.name, "seed", self.seed, 0)
        check_choice(self.name, "pooling", self.pooling, POOLINGS)
        check_float(self.name, "recent_ratio", self.recent_ratio, 0.0, 1.0)
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel_size", self.kernel_size, 1)
        self._anchors: dict[int, torch.Tensor] = {}

    @property
    def accumulates_attention(self) -> bool:  # type: ignore[override]
        return self.importance == "h2o"  # declared: obs.attention (H2O importance)

    @property
    def query_window(self) -> int:
        return 0 if self.importance == "h2o" else self.window  # declared: obs.queries (SnapKV importance)

    def n_rep(self, budget: int) -> int:
        return int(round(self.r * budget))

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        per_sequence = self.budget is None  # compression_ratio: the split is made per sequence
        d["representatives"] = None if per_sequence else self.n_rep(self.budget)
        d["important_tokens"] = None if per_sequence else self.budget - self.n_rep(self.budget)
        d["signature"] = "top-half bit per kv-head"
        return d

    def recent_window(self, budget: int) -> int:
        n_imp = budget - self.n_rep(budget)
        if self.importance == "h2o":
            return int(round(n_imp * self.recent_ratio))
        return min(self.window, n_imp)

    def score(self, obs: Observation) -> torch.Tensor:
        if self.importance == "h2o":
            return obs.attention
        return snapkv_scores(obs, self.window, self.kernel_size, self.pooling, self.name)

    def anchor_bits(self, layer: int, signatures: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Anchor signature per selecting head [H, B] bool."""
        B, T = signatures.shape
        H = candidates.shape[0]
        if self.anchor == "zeros":
            return torch.zeros(H, B, dtype=torch.bool, device=signatures.device)
        if self.anchor == "ones":
            return torch.ones(H, B, dtype=torch.bool, device=signatures.device)
        if self.anchor == "mean":
            c = candidates.float()  # [H, T]
            frac = (c @ signatures.float().T) / c.sum(-1, keepdim=True).clamp(min=1)  # [H, B]
            return frac > 0.5
        if layer not in self._anchors:
            g = torch.Generator().manual_seed(self.seed * 100003 + layer)
            self._anchors[layer] = torch.randint(0, 2, (B,), generator=g).bool()
        return self._anchors[layer].to(signatures.device)[None, :].expand(H, B)

    def select(self, obs: Observation, budget: int) -> torch.Tensor:
        return self.crush(self.score(obs), obs.lengths, obs.layer, budget)  # scores [H, T]

    def crush(self, scores: torch.Tensor, lengths: torch.Tensor, layer: int, budget: int | None = None) -> torch.Tensor:
        """Keep set [H, budget] from importance scores [H, T] of a table over budget (by default the configured
        budget)."""
        budget = self.budget if budget is None else budget
        H, T = scores.shape
        n_rep = self.n_rep(budget)
        important = top_tokens(scores, budget - n_rep, lengths, recent=self.recent_window(budget))  # [H, n_imp]
        candidates = valid_mask(lengths, T)
        rows = torch.arange(H, device=scores.device)[:, None].expand_as(important)
        ok = important >= 0
        candidates[rows[ok], important[ok]] = False
        if n_rep == 0:
            return important
        finite = torch.where(torch.isinf(scores), torch.full_like(scores, 1e30), scores)  # window = top bit
        signatures = top_half_bits(finite, lengths)  # [H(bits), T]
        order, m = hamming_order(candidates, signatures, self.anchor_bits(layer, signatures, candidates))
        reps = spread_picks(order, m, n_rep)  # [H, n_rep]
        return sort_keep(torch.cat([important, reps], dim=-1), T)
