"""The hook protocol between the engine and a compression method, and the do-nothing default.

The runtime never imports `methods`: the engine (and the model forward under it) takes any object with these
members; the app builds the method. `NoCompression` is the engine's default and the base of every method
(kvbench.methods.base.Method), so the no-op hooks are written once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # annotations only: the model forward imports this module, which runs no runtime import
    from kvbench.runtime.cache.append_plan import AppendPlan
    from kvbench.runtime.cache.kv_eviction import MethodCacheView
    from kvbench.runtime.model.rope import RotaryTable


@dataclass
class LayerContext:
    """What a compression method sees after one layer's attention of one forward step."""

    layer: int
    cache: MethodCacheView  # what a method may call on the cache (kvbench.runtime.cache.kv_eviction)
    plan: AppendPlan
    phase: str  # "prefill" or "decode"
    last_chunk: bool  # the final chunk of a prefill (always True in decode)
    q: torch.Tensor | None  # [S, Hq, Q, D] queries as used for attention (None: see hooks.decode_reads_attention)
    key_scores: torch.Tensor | None  # [S, H, T] attention mass per key slot (if the method asked)
    rotary: RotaryTable | None = None  # the model's RoPE table (methods that need pre-RoPE queries undo it)
    hidden: torch.Tensor | None = None  # [S, Q, E] the layer's attention input (after its norm), when the hook
    #                                     sets reads_hidden_states (KVzap's surrogate reads it); None otherwise


class CacheHooks(Protocol):
    """What the engine calls on a method (see methods.base.Method for the full contract)."""

    needs_key_scores: bool  # the attention must return per-key attention mass (ctx.key_scores)
    acts_after_attention: bool  # call after_attention after every layer (False: never called)
    # optional (getattr, default False): call before_attention in prefill steps after the layer's K/V are written and
    # before its attention, so the chunk's queries attend only to what the method keeps (PagedEviction's prototype)
    acts_before_attention: bool
    # in a decode step, after_attention reads ctx.q (False: only the cache and plan; ctx.q is then None, and the
    # fused CPU decode step may run every layer in one call and call it for each layer after the step: a layer's
    # cache is not read again in its step, so the result is the same)
    decode_reads_attention: bool
    store_pre_rope: bool  # cache keys before RoPE
    rope_mode: str  # "original" | "cache"
    # optional (getattr, default False): ctx.hidden holds the layer's attention input (after the layer's norm) in
    # every step; the fused CPU decode step and CUDA-graph replays (which keep no per-layer input) are not used
    reads_hidden_states: bool

    def attach(self, cache: MethodCacheView, model_config: Any) -> None: ...

    def after_attention(self, ctx: LayerContext) -> None: ...

    def before_attention(self, ctx: LayerContext) -> None: ...

    def on_sequence_end(self, slot: int) -> None: ...

    def on_fork(self, parent: int, child: int) -> None: ...

    # optional (looked up with getattr):
    #   bind_engine(engine)                         once, at the end of Engine.__init__: the engine (its model's
    #                                               weights, its public API for passes of the method's own)
    #   after_prefill_chunk(slot, token_ids, start_pos, last_chunk)
    #                                               after every Engine.forward_chunk step, with the chunk's tokens
    #                                               (not after a scratch=True chunk: the method's own pass)
    #   pruned_key_channels(head_dim) -> int        key channels per kv-head pruned by cache.prune_key_channels
    #                                               (ThinK): > 0 builds a cache storing pruned blocks in fewer bytes
    #   check_model(model_config)                   before the engine builds its cache: raise (one line) for a
    #                                               model the method cannot run on
    #   keep_uncompressed(slot, num_tokens)         the next num_tokens appended to slot stay uncompressed
    #   question_tokens(slot, num_tokens)           before each prefill chunk of a prompt whose last num_tokens
    #                                               are its question, compressed with it (query-aware; Finch's
    #                                               window)
    #   prompt_kept_fraction(slot) -> float | None  the fraction of slot's prompt KV kept after its compression
    #                                               (read at the sequence's first generated token)


class NoCompression:
    """Keeps every token: the engine's default when no method is given, and the no-op hooks every method
    inherits (kvbench.methods.base.Method)."""

    name = "full"
    needs_key_scores = False
    acts_after_attention = False
    acts_before_attention = False
    decode_reads_attention = True
    reads_hidden_states = False
    store_pre_rope = False
    rope_mode = "original"

    def pruned_key_channels(self, head_dim: int) -> int:
        """Key channels per kv-head this method prunes with cache.prune_key_channels (ThinK) on a model of
        `head_dim`; > 0 builds a cache that stores pruned blocks in fewer bytes (runtime.cache.pruned_key_cache)."""
        return 0

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        """Keep the cache (as the view a method may call: kvbench.runtime.cache.kv_eviction) and the model's config."""
        self.cache = cache
        self.model_config = model_config

    def after_attention(self, ctx: LayerContext) -> None:
        pass

    def before_attention(self, ctx: LayerContext) -> None:
        pass

    def on_sequence_end(self, slot: int) -> None:
        pass

    def on_fork(self, parent: int, child: int) -> None:
        pass
