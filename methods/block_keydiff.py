"""`block_keydiff`: KeyDiff's block-wise prompt compression (kvpress `BlockPress(press=KeyDiffPress(),
block_size=128)`, the registry's `block_keydiff`; KeyDiff, arXiv 2504.15364, processes the prompt block by block).

Per kv-head, with n = the budget (kvpress: int(prompt x (1 - compression_ratio))): the first n prompt tokens are
kept; then for each following block of `block_size` tokens, the kept tokens and the block are scored together by
KeyDiff (score = -cosine(k, mean of the set's L2-normalised keys): the anchor is the current set's, so a token's
score changes as the set moves on) and the n best stay. As kvpress, this runs once the whole prompt is in the
cache (kvpress: "not a true chunked-prefill implementation"); decode="evict" re-selects the whole table by KeyDiff
after every decode step. `key_diff` is the PagedEviction baseline (one pass over the prompt, block-wise decoding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


def key_diff_scores(keys: torch.Tensor) -> torch.Tensor:
    """kvpress KeyDiffPress.score over one set of keys [..., T, D] -> [..., T]."""
    keys = keys.float()
    anchor = F.normalize(keys, p=2, dim=-1).mean(dim=-2, keepdim=True)  # [..., 1, D]
    return -F.cosine_similarity(keys, anchor, dim=-1)


def block_keep(keys: torch.Tensor, n_kept: int, block_size: int) -> torch.Tensor:
    """kvpress BlockPress over KeyDiffPress for one kv-head: keys [T, D] -> the kept slots [n_kept], sorted."""
    T = keys.shape[0]
    block = min(block_size, T)
    kept = torch.arange(n_kept, device=keys.device)
    for start in range(n_kept, T, block):
        current = torch.cat([kept, torch.arange(start, min(start + block, T), device=keys.device)])
        kept = current[key_diff_scores(keys[current]).topk(n_kept).indices]
    return kept.sort().values


@register_method("block_keydiff")
@dataclass
class BlockKeyDiff(ScorerMethod):
    """KeyDiff over the prompt block by block (kvpress BlockPress(KeyDiffPress)); the prompt compressed once."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    block_size: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "block_size", self.block_size, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        """KeyDiff over the whole table (decode="evict"): [H, T], padding slots last."""
        valid = obs.valid  # [H, T]
        kn = F.normalize(obs.keys.float(), dim=-1) * valid[..., None]  # [H, T, D]
        anchor = kn.sum(1) / valid.sum(-1, keepdim=True).clamp(min=1)  # [H, D]
        return (-torch.einsum("htd,hd->ht", kn, F.normalize(anchor, dim=-1))).masked_fill(~valid, float("-inf"))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.table_lengths()
        if max(lengths) <= budget:
            return
        keep = torch.full((len(lengths), budget), -1, dtype=torch.long, device=obs.keys.device)
        for h, n in enumerate(lengths):
            kept = block_keep(obs.keys[h, :n], min(budget, n), self.block_size)
            keep[h, : kept.numel()] = kept
        self.keep(obs, keep)
