"""`chunkkv`: ChunkKV (arXiv 2502.00299; kvpress `ChunkKVPress`): whole chunks of the prompt kept, over any scorer.

`method=chunkkv method.base=snapkv` (the leaderboard's: SnapKV, chunk_length 20; the base's options under
`method.base_options`): the base scores every prompt token per kv-head on kvpress's scale (its score() times its
score_scale(); a token the base always keeps, as SnapKV's window, scores the largest finite score + 1, as kvpress
pads it); the prompt is cut into chunks of `chunk_length` tokens (the last one shorter when the length is not a
multiple); a chunk's score is the mean over its tokens of the scores summed over the kv-heads; the
max(1, int(chunks x (1 - ratio))) best chunks are kept whole, the same chunks in every kv-head of a layer (a prompt
shorter than one chunk: the base's own top-k). The ratio is `compression_ratio`, or 1 - budget / prompt length with
`budget=N`. kvbench's tables never exceed the budget: where kvpress's chunks would hold more (a prompt that is not
a multiple of chunk_length, its short last chunk not chosen), a chosen chunk that would overflow is passed over for
the next best that fits; where none fits (budget < chunk_length) the base's own top-k is kept.
The prompt is compressed once after prefill (decode="none", kvpress's ChunkKVPress).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_int
from kvbench.methods.selection import top_tokens
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation


def kvpress_scale(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """A base's scores [H, T] on kvpress's scale; +inf (always kept) -> the largest finite score + 1."""
    s = scores.float() * scale
    finite = torch.isfinite(s)
    top = float(s[finite].max()) if bool(finite.any()) else 0.0
    return torch.where(s == float("inf"), torch.full_like(s, top + 1.0), s)


def chunk_keep(scores: torch.Tensor, chunk_length: int, ratio: float, budget: int) -> Optional[torch.Tensor]:
    """The slots [n] (sorted) of the best whole chunks of a prompt scored [H, T] (kvpress ChunkKVPress.compress),
    at most `budget` of them; None when the prompt is shorter than one chunk or no chunk fits the budget."""
    T = scores.shape[-1]
    complete, rest = T // chunk_length, T % chunk_length
    if complete == 0:
        return None
    summed = scores.sum(dim=0)  # [T] over the kv-heads
    chunk_scores = summed[: complete * chunk_length].view(complete, chunk_length).mean(-1)
    if rest > 0:
        chunk_scores = torch.cat([chunk_scores, summed[-rest:].mean(-1, keepdim=True)])
    n_kept = max(1, int((complete + (rest > 0)) * (1 - ratio)))
    idx, held = [], 0
    for c in chunk_scores.argsort(descending=True, stable=True).tolist():  # kvpress's topk order
        if len(idx) == n_kept:
            break
        lo, hi = c * chunk_length, min((c + 1) * chunk_length, T)
        if held + hi - lo > budget:  # kvbench: a table never holds more than its budget
            continue
        idx.append(torch.arange(lo, hi, device=scores.device))
        held += hi - lo
    return torch.cat(idx).sort().values if idx else None


@register_method("chunkkv")
@dataclass
class ChunkKV(ScorerWrapper):
    """Whole chunks of the prompt kept, ranked by the base's scores summed over the kv-heads."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    reselects_by_score: ClassVar[bool] = False  # its own selection (no decode="interval")
    chunk_length: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "chunk_length", self.chunk_length, 1)

    def ratio_for(self, prompt_len: int, budget: int) -> float:
        if self.compression_ratio is not None:
            return float(self.compression_ratio)
        return max(0.0, 1.0 - budget / max(prompt_len, 1))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.table_lengths()
        T = max(lengths)
        if T <= budget:
            return
        if min(lengths) != T:
            raise RuntimeError(f"{self.name}: compresses a whole prompt once (tables of {lengths} tokens)")
        scores = kvpress_scale(self.inner.score(obs), self.inner.score_scale(obs))  # [H, T]
        idx = chunk_keep(scores, self.chunk_length, self.ratio_for(T, budget), budget)
        if idx is None:  # shorter than a chunk: the base's own top-k (kvpress delegates to the base press)
            keep = top_tokens(scores, budget, obs.lengths)
        else:
            keep = idx[None, :].expand(len(lengths), -1).contiguous()
        self.keep(obs, keep)
