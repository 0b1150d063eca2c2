"""`key_diff`: KeyDiff, a PagedEviction baseline: keep the keys least like the others.

Score of a token = -cosine(k_i, mean of the head's L2-normalised keys): tokens whose key points away
from the average direction are kept. Eviction is block-wise like PagedEviction: token-level down to
the budget after the prompt (the first block_size tokens kept unless prefill_keep_first_block=false),
then while decoding the whole block with the lowest summed score leaves when the newest block fills
and the table exceeds the budget (never the newest block; the first only if protect_first_block=false).
heads="per_head" (default, KeyDiff scores each head's keys) or "shared" (scores averaged over the
kv-heads of a layer, one token set for all of them). Keys are scored as cached (post-RoPE).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.methods.eviction import BlockScoreEvictionMethod
from kvbench.methods.base import register_method


@register_method("key_diff")
@dataclass
class KeyDiff(BlockScoreEvictionMethod):
    """-cosine to the mean normalised key; block-wise eviction."""

    heads: str = "per_head"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True

    def token_scores(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # k: [H, T, D], valid [H, T] -> [H, T]
        kn = F.normalize(k, dim=-1) * valid[..., None]
        mean = kn.sum(1) / valid.sum(-1, keepdim=True).clamp(min=1)  # [H, D]
        return -torch.einsum("htd,hd->ht", kn, F.normalize(mean, dim=-1))
