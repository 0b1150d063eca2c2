"""The interface every compression method implements, and the registry of methods by name."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from kvbench.errors import UserError
from kvbench.registry import Registry
from kvbench.runtime.model import LayerContext


@dataclass
class Method:
    """A KV-cache compression method: which tokens stay (storage codecs are chosen with `quant=`).

    The engine calls (the hook protocol; the runtime knows nothing else of methods):
      attach(cache, model_config)   once, before any sequence
      after_attention(ctx)          after every layer's attention of every forward step (prefill chunks and
                                    decode steps) when `acts_after_attention`; evict here through the cache's
                                    named operations (keep_tokens, evict_blocks, drop_slots)
      on_sequence_end(slot)         when a sequence's blocks are freed (finished or preempted)
      on_fork(parent, child)        when a sequence is forked (shared blocks): copy per-sequence state
    `budget` is the most KV tokens kept per sequence, per layer, per kv-head (None = unlimited).
    `evicts` says whether the method ever drops tokens (False: the budget is meaningless and recorded as null).
    """

    name: ClassVar[str] = "base"
    needs_key_scores: ClassVar[bool] = False
    evicts: ClassVar[bool] = False
    acts_after_attention: ClassVar[bool] = False
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
                raise UserError(f"invalid budget {self.budget!r}: expected a positive integer or null")

    # --- runtime points -------------------------------------------------------------
    @property
    def store_pre_rope(self) -> bool:
        """Whether keys are cached before RoPE (rotated at read time)."""
        return False

    @property
    def rope_mode(self) -> str:
        """"original" (keys keep their token positions) or "cache" (re-indexed inside the cache)."""
        return "original"

    def attach(self, cache: Any, model_config: Any) -> None:
        self.cache = cache
        self.model_config = model_config

    def after_attention(self, ctx: LayerContext) -> None:
        pass

    def on_sequence_end(self, slot: int) -> None:
        pass

    def on_fork(self, parent: int, child: int) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        """The method's settings, recorded in every run's results."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


METHODS: Registry[type[Method]] = Registry("method", base=Method, package="kvbench.methods")
register_method = METHODS.register
