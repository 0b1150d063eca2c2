"""The method contract: everything of the runtime a compression method may use, in one module.

A method (methods/*.py, or a researcher's own file) imports the runtime from here only:
  NoCompression, CacheHooks     the method protocol (every member, with its default; CacheHooks: the same class)
  LayerContext                  what a hook sees after (or before) one layer's attention of one forward step
  MethodCacheView               the cache operations a method may call (keep_tokens, evict_blocks, drop_slots, ...)
  Observation                   what a scorer reads for one (sequence, layer): keys, values, positions, lengths,
                                the observation window's queries and the accumulated attention mass when asked for
  RotaryTable, apply_rotary, rotate_half       RoPE, for methods that undo or redo it
  tensor-parallel helpers       for methods that rank tokens across kv-heads on a sharded model
  Engine                        for methods that run passes of their own (DuoAttention's calibration)
  PageRetrieval                 what a retrieval method (Quest) sets as `page_retrieval`: decode steps then read
                                only each query head's top blocks by their key summaries

Nothing in kvbench/runtime imports this module: it sits on top of the runtime, as the door methods come in by.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from kvbench.runtime.cache.kv_eviction import MethodCacheView
from kvbench.runtime.cache.page_retrieval import PageRetrieval
from kvbench.runtime.hooks import CacheHooks, LayerContext, NoCompression
from kvbench.runtime.model.rope import RotaryTable, apply_rotary, rotate_half
from kvbench.runtime.model.tensor_parallel import (full_kv_heads, gather_head_scores, local_keep, sum_over_ranks,
                                                   tp_size_of)
from kvbench.runtime.serving.engine import Engine

__all__ = [
    "CacheHooks", "NoCompression", "LayerContext", "MethodCacheView", "Observation", "RotaryTable", "apply_rotary",
    "rotate_half", "full_kv_heads", "gather_head_scores", "local_keep", "sum_over_ranks", "tp_size_of", "Engine",
    "PageRetrieval",
]


@dataclass
class Observation:
    """What a scorer may read for one sequence in one layer, gathered by the runtime from the step's LayerContext.

    keys, values [H_kv, T, D] as cached (pre- or post-RoPE as the method asked: `pre_rope`), positions [H_kv, T]
    (each token's original position; -1 past a head's length), lengths [H_kv] (valid slots per kv-head, read live
    from the cache). The cached tensors are gathered on first read only, so a scorer that reads none of them pays
    nothing; `refresh()` drops them after the tables changed.
    queries [H_q, W, D] and query_positions [W]: the observation window (the last W queries of the sequence, carried
    across prefill chunks) when the method declares `query_window`; None otherwise.
    attention [H_kv, T]: attention mass each cached token received, accumulated over every query so far (summed over
    each kv-head's query heads) when the method declares `accumulates_attention`; None otherwise.
    phase "prefill" | "decode"; last_chunk: the prompt's final chunk (always True in decode); layer; slot; row: the
    sequence's row in the step; tokens_seen: tokens appended to the sequence so far, evicted ones included;
    model_config; rotary: the RoPE table; step_queries [H_q, Q, D] / step_query_positions [Q]: this step's own
    queries (None where the runtime gave none: hooks.decode_reads_attention); key_scores [H_kv, T]: this step's
    attention mass per key slot (when the method asked for it); hidden_states [Q, E]: this step's attention input
    (when the method sets reads_hidden_states).
    """

    layer: int
    slot: int
    row: int
    phase: str
    last_chunk: bool
    tokens_seen: int
    model_config: Any
    cache: Any = field(repr=False)
    context: Optional[LayerContext] = field(default=None, repr=False)
    queries: Optional[torch.Tensor] = None  # [H_q, W, D]
    query_positions: Optional[torch.Tensor] = None  # [W]
    attention: Optional[torch.Tensor] = None  # [H_kv, T]
    rotary: Optional[RotaryTable] = None
    _kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default=None, repr=False)

    @classmethod
    def of(cls, ctx: LayerContext, row: int, slot: int, model_config: Any) -> "Observation":
        """The observation of the sequence in `slot` (row `row` of the step) in ctx's layer."""
        return cls(layer=ctx.layer, slot=slot, row=row, phase=ctx.phase, last_chunk=ctx.last_chunk,
                   tokens_seen=int(ctx.cache.tokens_seen[slot]), model_config=model_config, cache=ctx.cache,
                   context=ctx, rotary=ctx.rotary)

    def _gathered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = self.cache.gather(self.layer, self.slot)  # [H, T, D], [H, T, D], [H, T]
        return self._kv

    def refresh(self) -> None:
        """Forget the gathered K/V (the tables changed)."""
        self._kv = None

    @property
    def keys(self) -> torch.Tensor:
        """[H_kv, T, D] keys as cached."""
        return self._gathered()[0]

    @property
    def values(self) -> torch.Tensor:
        """[H_kv, T, D] values as cached."""
        return self._gathered()[1]

    @property
    def positions(self) -> torch.Tensor:
        """[H_kv, T] original token positions of the cached slots."""
        return self._gathered()[2]

    @property
    def lengths(self) -> torch.Tensor:
        """[H_kv] tokens each kv-head's table holds now."""
        return self.cache.lengths[self.slot, self.layer]

    def table_lengths(self) -> list[int]:
        """lengths as Python ints, from the step's host copy (no device read; exact until this layer evicts)."""
        return self.context.plan.table_lengths(self.row, self.layer)

    @property
    def pre_rope(self) -> bool:
        """Whether `keys` are cached before RoPE."""
        return bool(self.cache.store_pre_rope)

    @property
    def step_queries(self) -> Optional[torch.Tensor]:
        """[H_q, Q, D] this step's queries as used by attention (None: the runtime gave none)."""
        q = self.context.q
        return None if q is None else q[self.row]

    @property
    def step_query_positions(self) -> torch.Tensor:
        """[Q] positions of this step's tokens."""
        return self.context.plan.query_positions[self.row]

    @property
    def hidden_states(self) -> Optional[torch.Tensor]:
        """[Q, E] this step's attention input of the layer (after its norm), when the method sets
        `reads_hidden_states`; None otherwise."""
        h = self.context.hidden
        return None if h is None else h[self.row]

    @property
    def key_scores(self) -> Optional[torch.Tensor]:
        """[H_kv, T] this step's attention mass per key slot (None unless the method asked for it)."""
        ks = self.context.key_scores
        return None if ks is None else ks[self.row]

    @property
    def valid(self) -> torch.Tensor:
        """[H_kv, T] True where a slot holds a token (T = the longest table of the layer, as `keys`)."""
        T = self.keys.shape[1]
        return torch.arange(T, device=self.lengths.device)[None, :] < self.lengths[:, None]

    @property
    def num_kv_heads(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.cache.head_dim)

    @property
    def block_size(self) -> int:
        return int(self.cache.block_size)
