"""`paged_eviction`: PagedEviction (arXiv 2509.04377), block-wise eviction for paged caches.

Token importance needs no attention: S_i = ||V_i||_2 / ||K_i||_2 (a small key norm goes with high
attention), on the keys as cached (post-RoPE; RoPE keeps norms anyway).
  prefill: if a table holds more than `budget` tokens, the lowest-S tokens are evicted (token level)
      down to the budget (once after the prompt, or after every chunk with prefill_mode=streaming);
      with prefill_keep_first_block (default) the first block_size prompt tokens are kept too, so the
      block that decoding protects still holds the attention sinks. The paper's text evicts purely by
      S (prefill_keep_first_block=false): sink tokens have small ||V||, and on SmolLM2-135M that evicts
      token 0 in ~70% of the layer-heads at budget 256 of 1024 and greedy generation degenerates;
  decode: only when the newest block has just filled and the table exceeds the budget, one whole
      block leaves: the one with the lowest sum of S over its tokens, never the newest block and,
      with protect_first_block (default), never the first. No K/V moves; the block is freed at once.
heads="shared" (default, the authors' prototype): S averaged over the kv-heads of a layer, one
token/block set shared by them; heads="per_head": each kv-head evicts on its own scores.
The budget must be >= 2 blocks (>= 1 without first-block protection); the paper uses C >= 3B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.eviction import BlockScoreEvictionMethod
from kvbench.methods.base import register_method


@register_method("paged_eviction")
@dataclass
class PagedEviction(BlockScoreEvictionMethod):
    """||V||/||K|| token scores; token-level prefill, block-level decode eviction."""

    heads: str = "shared"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True

    def token_scores(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # k, v: [H, T, D] -> [H, T]
        return v.norm(dim=-1) / k.norm(dim=-1).clamp(min=1e-6)
