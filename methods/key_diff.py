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

from kvbench.methods.base import register_method
from kvbench.methods.paged_eviction import BlockScorerMethod
from kvbench.runtime.contract import Observation


@register_method("key_diff")
@dataclass
class KeyDiff(BlockScorerMethod):
    """-cosine to the mean normalised key; block-wise eviction."""

    heads: str = "per_head"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True

    def score(self, obs: Observation) -> torch.Tensor:
        valid = obs.valid  # [H, T]
        kn = F.normalize(obs.keys.float(), dim=-1) * valid[..., None]  # keys [H, T, D]
        mean = kn.sum(1) / valid.sum(-1, keepdim=True).clamp(min=1)  # [H, D]
        return -torch.einsum("htd,hd->ht", kn, F.normalize(mean, dim=-1))
