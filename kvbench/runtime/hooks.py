"""The method protocol: every member a compression method may define, declared once with its default
(`NoCompression`), and LayerContext, what a hook sees.

The runtime never imports `methods`: the engine (and the model forward under it) takes any object with these
members; the app builds the method. `NoCompression` is the engine's default and the base of every method
(kvbench.methods.base.Method), so the defaults are written once and read as plain attributes everywhere (the plan
and the tasks too); `declared` gives another object the same defaults. docs/adding.md lists the members.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: the model forward imports this module, which runs no runtime import
    from kvbench.runtime.cache.append_plan import AppendPlan
    from kvbench.runtime.cache.kv_eviction import MethodCacheView
    from kvbench.runtime.cache.page_retrieval import PageRetrieval
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


class NoCompression:
    """Keeps every token: the engine's default when no method is given, and the base of every method
    (kvbench.methods.base.Method).

    The method protocol, declared once: every member the runtime, the plan or a task reads of a method is here with
    its default, so the readers use plain attributes and calls (no probing; tests/app/test_method_protocol.py keeps
    it so). A method overrides the members it needs; an object that does not subclass this class goes through
    `declared` first. docs/adding.md's table says when each is called.
    """

    # --- the method protocol: flags (class attributes; a method sets its own) ---------------------------------
    name = "full"
    needs_key_scores = False  # attention returns per-key attention mass (ctx.key_scores) [S, H, T]
    acts_after_attention = False  # after_attention after every layer of every step (False: never called)
    # before_attention in prefill steps, after the layer's K/V are written and before its attention, so the chunk's
    # queries attend only to what the method keeps (PagedEviction's prototype)
    acts_before_attention = False
    # in a decode step, after_attention reads ctx.q (False: only the cache and plan; ctx.q is then None, and the
    # fused CPU decode step may run every layer in one call and call it for each layer after the step: a layer's
    # cache is not read again in its step, so the result is the same)
    decode_reads_attention = True
    # ctx.hidden holds the layer's attention input (after its norm) in every step; the fused CPU decode step and
    # CUDA-graph replays (which keep no per-layer input) are then not used
    reads_hidden_states = False
    store_pre_rope = False  # cache keys before RoPE (rotated at read time)
    rope_mode = "original"  # "original" (keys keep their positions) | "cache" (re-indexed inside the cache)
    # a retrieval method's block selection (runtime.cache.page_retrieval.PageRetrieval), set by attach: decode
    # steps then read only each query head's top blocks
    page_retrieval: PageRetrieval | None = None
    evicts = False  # ever drops tokens (False: the budget is meaningless; kvbench.run.spec reads it by class)
    retrieves = False  # reads only some blocks per decode step (`budget`: tokens read; quest)
    needs_budget = True  # a budget is a count of tokens (False: a threshold rule, dms)
    reads_question = False  # reads the prompt's question extent (question_tokens; kvbench.run.spec checks its source)

    # --- the method protocol: calls, in the order a run makes them ----------------------------------------------
    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads (kvbench.run.plan): raise UserError (one line) for settings this method refuses."""

    def tensor_parallel_refusal(self) -> str | None:
        """Why this method cannot run on a model sharded by kv-head (runtime.tensor_parallel > 1), or None. Scores
        per kv-head work on a shard unchanged; a method that ranks tokens across kv-heads gathers its scores over the
        ranks (methods.eviction) or names its reason here."""
        return None

    def check_model(self, model_config: Any) -> None:
        """Before the engine builds its cache: raise (one line) for a model the method cannot run on."""

    def pruned_key_channels(self, head_dim: int) -> int:
        """Key channels per kv-head this method prunes with cache.prune_key_channels (ThinK) on a model of
        `head_dim`; > 0 builds a cache that stores pruned blocks in fewer bytes (runtime.cache.pruned_key_cache)."""
        return 0

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        """Keep the cache (as the view a method may call: kvbench.runtime.cache.kv_eviction) and the model's config."""
        self.cache = cache
        self.model_config = model_config

    def bind_engine(self, engine: Any) -> None:
        """Once, at the end of Engine.__init__: the engine (its weights, its API for passes of the method's own)."""

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        """The next `num_tokens` appended to `slot` (one forward step) stay uncompressed: a question appended after
        its context was compressed (kvpress's query-agnostic protocol); eviction methods raise that sequence's
        budget by num_tokens (methods.eviction)."""

    def question_tokens(self, slot: int, num_tokens: int) -> None:
        """Before each prefill chunk of a prompt whose last `num_tokens` are its question, compressed with it."""

    def before_attention(self, ctx: LayerContext) -> None:
        """See acts_before_attention."""

    def after_attention(self, ctx: LayerContext) -> None:
        """See acts_after_attention."""

    def after_prefill_chunk(self, slot: int, token_ids: list[int], start_pos: int, last_chunk: bool) -> None:
        """After every prefill chunk's step (not a scratch=True chunk: the method's own pass), with its tokens."""

    def prompt_kept_fraction(self, slot: int) -> float | None:
        """The fraction of `slot`'s prompt KV kept after its compression (read at its first generated token)."""
        return None

    def decode_overshoot(self) -> int:
        """Tokens a table may hold above the budget after a decode step (a staging buffer, a compression
        interval): the bound on a table's size is budget + decode_overshoot()."""
        return 0

    def on_rollback(self, slot: int) -> None:
        """Speculative decoding cut `slot`'s tables back (their newest slots went)."""

    def on_fork(self, parent: int, child: int) -> None:
        """A sequence was forked (shared blocks): copy its per-sequence state."""

    def on_sequence_end(self, slot: int) -> None:
        """A sequence's blocks were freed (finished or preempted): drop its state."""

    def prefill_totals(self) -> list | None:
        """The sums prefill_stats averages (tokens kept, prompt tokens, (prompt, layer) count), or None: no count
        kept (tasks sum them over data-parallel ranks)."""
        return None

    def prefill_stats(self, totals: list | None = None) -> dict[str, Any]:
        """Tokens kept after each prompt's compression (recorded in a run's metrics); {} when none are counted."""
        return {}


CacheHooks = NoCompression  # the protocol's name in annotations and in kvbench.runtime.contract's exports

_PROTOCOL = frozenset(n for n in vars(NoCompression) if not n.startswith("_"))
# what an object that does not subclass NoCompression gets for a member it lacks: NoCompression's default, except
# that its after_attention is called (such an object is a hook by its after_attention alone: the tests' recorders)
_UNDECLARED = {"acts_after_attention": True}


class _Declared:
    """An object that does not subclass NoCompression, with the protocol's defaults for the members it lacks;
    every other attribute (and every write) is the object's own."""

    def __init__(self, obj: Any):
        object.__setattr__(self, "_obj", obj)

    def __getattr__(self, name: str) -> Any:
        obj = object.__getattribute__(self, "_obj")
        try:
            return getattr(obj, name)
        except AttributeError:
            if name not in _PROTOCOL:
                raise
        if name in _UNDECLARED:
            return _UNDECLARED[name]
        default = getattr(NoCompression, name)
        return default.__get__(obj) if callable(default) else default  # a default call acts on the object

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_obj"), name, value)


def declared(method: Any) -> NoCompression:
    """`method` as the protocol: itself when it subclasses NoCompression, NoCompression() for None, else a view with
    the protocol's defaults for what it lacks (the one place members are probed)."""
    if isinstance(method, NoCompression):
        return method
    if method is None:
        return NoCompression()
    return _Declared(method)  # type: ignore[return-value]
