"""`paged_eviction`: PagedEviction (arXiv 2509.04377), block-wise eviction for paged caches.

Token importance needs no attention: S_i = ||V_i||_2 / ||K_i||_2 (a small key norm goes with high
attention), on the keys as cached (post-RoPE; RoPE keeps norms anyway). The defaults are the authors' code
(github krishnateja95/PagedEviction, `modeling_llama.py`, `forward_local_eviction`):
  prefill: if a table holds more than `budget` tokens, it keeps the first block and its last, possibly
      partial, block (the prompt's last P % block_size tokens, or a whole block: a chat prompt's
      "<|im_start|>assistant\\n" lives there) and the highest-S tokens in between, up to the budget (token
      level; once after the prompt, or after every chunk with prefill_mode=streaming);
  decode: only when the newest block has just filled and the table exceeds the budget, one whole block
      leaves: the one with the lowest sum of S among the `decode_topk` oldest blocks after the first
      (blocks 1 .. min(1 + topk, blocks - 1) - 1, the authors' `candidate_pages`; topk 3), never the first
      block and never the newest. No K/V moves; the block is freed at once.
Options relax these rules: protect_last_block=false (prefill by score alone after the first block: on
SmolLM2-135M at budget 256 the chat template's tail is evicted and greedy output degenerates to
"ThisThisThis..."), decode_topk=null (any block but the first and the newest is a candidate),
prefill_keep_first_block=false / protect_first_block=false (no first block kept at prefill / while decoding).
heads="shared" (default, the authors' prototype: S averaged over the kv-heads of a layer, one token/block set
shared by them); heads="per_head": each kv-head evicts on its own scores.
The budget must hold the protected blocks: >= 2 blocks by default; the paper uses C >= 3B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.methods.eviction import BlockScoreEvictionMethod
from kvbench.methods.base import register_method


@register_method("paged_eviction")
@dataclass
class PagedEviction(BlockScoreEvictionMethod):
    """||V||/||K|| token scores; token-level prefill (first and last block kept), block-level decode eviction."""

    heads: str = "shared"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True
    protect_last_block: bool = True
    decode_topk: int | None = 3

    def token_scores(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        # k, v: [H, T, D] -> [H, T]
        return v.norm(dim=-1) / k.norm(dim=-1).clamp(min=1e-6)
