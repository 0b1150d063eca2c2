"""`paged_eviction`: PagedEviction (arXiv 2509.04377), block-wise eviction for paged caches, and its rules as
`BlockScorerMethod`, the block-level shape of the method contract (KeyDiff reuses them).

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
timing="after_attention" (default): the prompt attends over all its tokens, then the cache is cut (every other
method's timing, and what the vLLM port does); timing="before_attention": the authors' HF prototype
(`forward_local_eviction`) cuts K/V before the layer's attention, so the prompt's queries attend only to the kept
tokens (docs/methods.md).
The budget must hold the protected blocks: >= 2 blocks by default; the paper uses C >= 3B.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import Method, register_method
from kvbench.methods.checks import check_bool, check_choice, check_int
from kvbench.methods.eviction import HEAD_MODES, EvictionMethod
from kvbench.methods.selection import top_tokens
from kvbench.runtime.contract import LayerContext, MethodCacheView, Observation, gather_head_scores, tp_size_of

TIMINGS = ("after_attention", "before_attention")


@dataclass
class BlockScorerMethod(EvictionMethod, Method):
    """PagedEviction-style eviction by a per-token score: implement `score(obs) -> [H, T]` (higher = keep).

    Prefill: token-level eviction of the lowest-scoring tokens down to the budget; with
    `prefill_keep_first_block` the first block_size prompt tokens (the attention sinks) are kept, with
    `protect_last_block` the table's last, possibly partial, block (the prompt's end: a chat template's
    "<|im_start|>assistant\\n") too.
    Decode: when the newest block has just filled and the table exceeds the budget, the whole block
    with the lowest summed score leaves (never the newest block; never the first if
    `protect_first_block`), chosen among the `decode_topk` oldest blocks after the first (None: any).
    No K/V moves; the block returns to the pool at once.
    heads="shared": scores averaged over the kv-heads of a layer, one token/block set for all heads (on a model
    sharded by kv-head, runtime.tensor_parallel, the average is over every rank's heads: each rank gathers the
    others' token scores, one all-gather per eviction, so all ranks drop the same blocks);
    heads="per_head": each kv-head selects on its own scores (a shard needs nothing from the other ranks).
    """

    granularity: ClassVar[str] = "block"
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("block", "none")
    decode_reads_attention: ClassVar[bool] = False  # scores read the cached K/V only
    decode: str = "block"
    heads: str = "shared"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True
    protect_last_block: bool = False
    decode_topk: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "heads", self.heads, HEAD_MODES)
        check_bool(self.name, "protect_first_block", self.protect_first_block)
        check_bool(self.name, "prefill_keep_first_block", self.prefill_keep_first_block)
        check_bool(self.name, "protect_last_block", self.protect_last_block)
        if self.decode_topk is not None:
            check_int(self.name, "decode_topk", self.decode_topk, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        """Importance [H, T] of every cached token of obs's layer (higher = keep)."""
        raise NotImplementedError(f"method {self.name!r} implements no score(obs)")

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        self._check_budget(cache.block_size)

    def act(self, ctx: LayerContext) -> None:
        if ctx.phase == "decode" and self.compression_ratio is None and not self._may_evict_in_decode(ctx):
            return  # most decode steps: no table of this layer reached a block boundary above the budget
        super().act(ctx)

    def _may_evict_in_decode(self, ctx: LayerContext) -> bool:
        """Whether EvictionMethod.after_attention could act on this layer in this decode step: for some sequence, a
        first step, or a table above the configured budget (a sequence's budget is never less) whose newest block
        has just filled, whose heads differ in length, or that runs a block over (evict_decode's cases)."""
        bs, lo, seen = ctx.cache.block_size, self.budget, ctx.cache.tokens_seen
        for i, slot in enumerate(ctx.plan.slot_list):
            lengths = ctx.plan.table_lengths(i, ctx.layer)
            n = max(lengths)
            if seen[slot] == 1 or (n > lo and (n % bs == 0 or min(lengths) != n or n >= lo + bs)):
                return True
        return False

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: the budget must hold the blocks decoding never evicts."""
        self._check_budget(settings.runtime.block_size)

    def min_budget(self) -> int:
        """The blocks never evicted (a compression_ratio never gives a sequence less)."""
        return self._protected_blocks() * self.cache.block_size

    def _protected_blocks(self) -> int:
        """Blocks a table always keeps: decoding's first (if protected) and newest; prefill's first and last."""
        decode = 2 if self.protect_first_block else 1
        prefill = int(self.prefill_keep_first_block) + int(self.protect_last_block)
        return max(decode, prefill)

    def _check_budget(self, block_size: int) -> None:
        need = self._protected_blocks() * block_size
        if self.budget is not None and self.budget < need:
            raise UserError(
                f"invalid budget={self.budget} for method {self.name!r}: it needs budget >= {need} with "
                f"runtime.block_size {block_size} (protect_first_block={self.protect_first_block}, "
                f"prefill_keep_first_block={self.prefill_keep_first_block}, "
                f"protect_last_block={self.protect_last_block})")

    def _scores(self, obs: Observation) -> torch.Tensor:
        """Token scores [H, T] (0 past a head's length), averaged over the layer's kv-heads with heads="shared"."""
        lengths = obs.lengths
        valid = obs.valid
        s = self.score(obs).masked_fill(~valid, 0.0)  # [H, T]
        if self.heads == "shared":
            cfg = obs.model_config
            if tp_size_of(cfg) > 1:  # the mean over every kv-head of the layer, on every rank
                every, _ = gather_head_scores(s, lengths, cfg, obs.tokens_seen)
                s = every.mean(dim=0, keepdim=True)[:, : s.shape[1]].expand_as(s)
            else:
                s = s.mean(dim=0, keepdim=True).expand_as(s)
        return s

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.lengths
        if int(lengths.max()) <= budget:
            return
        s = self._scores(obs)
        bs = obs.block_size
        sinks = bs if self.prefill_keep_first_block else 0
        # the table's last, possibly partial, block: after a prompt, its last P % bs (or bs) tokens
        tail = (int(lengths.max()) % bs or bs) if self.protect_last_block else 0
        if self.heads == "shared":
            keep = top_tokens(s[:1], budget, lengths[:1], recent=tail, sinks=sinks).expand(s.shape[0], -1)
        else:
            keep = top_tokens(s, budget, lengths, recent=tail, sinks=sinks)
        self.keep(obs, keep)

    def evict_decode(self, obs: Observation, budget: int) -> None:
        bs = obs.block_size
        lengths = obs.table_lengths()
        n = max(lengths)
        if n <= budget:
            return
        if n % bs or min(lengths) != n:
            if n >= budget + bs:  # not reached by plain decoding: fall back to tokens
                self.evict_prefill(obs, budget)
            return
        s = self._scores(obs)
        H, nb = s.shape[0], n // bs
        block = s.reshape(H, nb, bs).sum(-1)  # [H, nb]
        first = 1 if self.protect_first_block else 0
        end = nb - 1  # never the newest block
        if self.decode_topk is not None:  # the authors' code: only the oldest topk blocks after the first
            end = min(first + self.decode_topk, end)
        cand = block[:, first: end]
        n_drop = min(-(-(n - budget) // bs), cand.shape[1])
        if n_drop <= 0:
            return
        drop = cand.topk(n_drop, dim=-1, largest=False).indices + first  # [H, n_drop]
        if self.heads == "shared":
            drop = drop[:1].expand(H, -1)
        obs.cache.evict_blocks_on_device(obs.layer, obs.slot, n, drop)  # the ids reach the pool with the step's tokens


@register_method("paged_eviction")
@dataclass
class PagedEviction(BlockScorerMethod):
    """||V||/||K|| token scores; token-level prefill (first and last block kept), block-level decode eviction."""

    heads: str = "shared"
    protect_first_block: bool = True
    prefill_keep_first_block: bool = True
    protect_last_block: bool = True
    decode_topk: int | None = 3
    timing: str = "after_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.name, "timing", self.timing, TIMINGS)

    @property
    def acts_before_attention(self) -> bool:
        return self.timing == "before_attention"

    def score(self, obs: Observation) -> torch.Tensor:
        # k, v: [H, T, D] -> [H, T]
        return obs.values.float().norm(dim=-1) / obs.keys.float().norm(dim=-1).clamp(min=1e-6)
