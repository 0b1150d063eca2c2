"""Behaviours by composition: a method over another registered scorer (kvpress's AdaKVPress(press) shape).

`ScorerWrapper` builds its `base` (a registered plain scorer, with `base_options` and this method's budget or
compression_ratio); the base observes every step and scores the tokens, the wrapper selects. Both share one
per-sequence state (so it is realigned on eviction and dropped with the sequence). `head_adaptive` chooses the
selection: per kv-head top-budget (False) or the layer's kv_heads x budget best (kv-head, token) pairs jointly
(True, Ada-KV's allocation: heads keep different numbers of tokens and hold different numbers of blocks; each head
first keeps its recent window and its `min_tokens_per_head(budget)` best ones).

On a model sharded by kv-head (runtime.tensor_parallel), the joint choice ranks every kv-head of the layer, so each
rank gathers the others' scores (one all-gather per eviction) and keeps its own heads' share of the result; whether
a layer is over its budget is summed over the ranks (one all-reduce), so every rank decides alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.base import METHODS, Method, build_method
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.selection import top_tokens, top_tokens_in_layer
from kvbench.runtime.contract import (MethodCacheView, Observation, full_kv_heads, gather_head_scores, local_keep,
                                      sum_over_ranks, tp_size_of)


def plain_scorers() -> list[str]:
    """Registered methods that score tokens and keep the top ones (ScorerMethod's own selection): the methods a
    wrapper (adakv, criticalkv) may take as its `base`."""
    return sorted(n for n in METHODS.names()
                  if issubclass(METHODS[n], ScorerMethod) and METHODS[n].select is ScorerMethod.select)


def select_in_layer(obs: Observation, scores: torch.Tensor, budget: int, recent: int, min_per_head: int) -> torch.Tensor:
    """Head-adaptive keep set [H, n] of obs's layer: the layer's kv_heads x budget best (kv-head, token) pairs;
    gathered over the tensor-parallel ranks where the model is sharded by kv-head."""
    lengths, cfg = obs.lengths, obs.model_config
    if tp_size_of(cfg) > 1:  # rank the (kv-head, token) pairs of every rank's heads
        scores, lengths = gather_head_scores(scores, lengths, cfg, obs.tokens_seen)
    keep = top_tokens_in_layer(scores, lengths.shape[0] * budget, lengths, recent=recent, min_per_head=min_per_head)
    return local_keep(keep, cfg) if tp_size_of(cfg) > 1 else keep


def layer_over_budget(obs: Observation, budget: int) -> bool:
    """Whether obs's layer holds more than kv_heads x budget tokens (every rank's heads on a sharded model)."""
    held, heads, cfg = sum(obs.table_lengths()), obs.num_kv_heads, obs.model_config
    if tp_size_of(cfg) > 1:  # the layer's tables on every rank
        held, heads = sum_over_ranks(held, cfg, obs.lengths.device), full_kv_heads(cfg)
    return held > heads * budget


@dataclass
class ScorerWrapper(EvictionMethod, Method):
    """A method over another scoring method: the base scores, the wrapper (re-weights and) selects."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    decode: str = "none"
    base: str = "snapkv"
    base_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_base()
        ratio = getattr(self, "compression_ratio", None)  # the base gets the same knob as the wrapper
        knob = {} if ratio is None else {"compression_ratio": ratio}
        self.inner = build_method(self.base, self.budget, **knob, options_key="method.base_options",
                                  **dict(self.base_options))
        self.inner._state = self._state  # one per-sequence state for both

    def check_base(self) -> None:
        """UserError (one line) unless `base` is a plain scorer and `base_options` a mapping."""
        bases = plain_scorers()
        if self.base not in bases:
            raise UserError(f"invalid {self.name}.base={self.base!r}: choose one of {', '.join(bases)}")
        if not isinstance(self.base_options, dict):
            raise UserError(f"invalid {self.name}.base_options={self.base_options!r}: expected a mapping of "
                            f"{self.base}'s options")

    # --- what the base declares -------------------------------------------------------------------

    @property
    def head_adaptive(self) -> bool:
        return True

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "layer" if self.head_adaptive else "table"

    @property
    def needs_key_scores(self) -> bool:
        return self.inner.needs_key_scores

    @property
    def query_window(self) -> int:
        return self.inner.query_window

    def observes_in_decode(self) -> bool:
        return self.inner.observes_in_decode()

    @property
    def store_pre_rope(self) -> bool:
        return self.inner.store_pre_rope

    @property
    def reads_hidden_states(self) -> bool:
        return bool(self.inner.reads_hidden_states)

    @property
    def rope_mode(self) -> str:
        return self.inner.rope_mode

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        self.inner.attach(cache, model_config)
        self.inner._state = self._state

    def bind_engine(self, engine: Any) -> None:
        """The engine this method runs in (the hook protocol's optional `bind_engine`): model weights."""
        self.engine = engine
        self.inner.bind_engine(engine)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["base_settings"] = {k: v for k, v in self.inner.describe().items() if k != "budget"}
        return d

    # --- the base observes and scores; the wrapper selects -----------------------------------------
    def observe(self, obs: Observation) -> None:
        self.inner.observe(obs)

    def recent_window(self, budget: int) -> int:
        return self.inner.recent_window(budget)

    def min_tokens_per_head(self, budget: int) -> int:
        return 0

    def recent_kept(self, obs: Observation, budget: int) -> int:
        """At prefill the base's recent window alone, no newest-token floor: kvpress's AdaKVPress and CriticalKVPress
        compress the prompt by score alone, so a prompt's last token stays only if it scores high enough (or lies in
        the base's window, as SnapKV's). While decoding (decode="evict") the newest token stays."""
        if obs.phase == "prefill":
            return min(self.recent_window(budget), budget)
        return min(max(1, self.recent_window(budget)), budget)

    def score(self, obs: Observation) -> torch.Tensor:
        return self.inner.score(obs)

    def select(self, obs: Observation, budget: int, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
        scores = self.score(obs) if scores is None else scores
        if self.head_adaptive:
            return select_in_layer(obs, scores, budget, self.recent_kept(obs, budget), self.min_tokens_per_head(budget))
        return top_tokens(scores, budget, obs.lengths, recent=self.recent_kept(obs, budget))

    def evict_to_budget(self, obs: Observation, budget: int) -> None:
        over = layer_over_budget(obs, budget) if self.head_adaptive else int(obs.lengths.max()) > budget
        if over:
            self.keep(obs, self.select(obs, budget))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        self.evict_to_budget(obs, budget)

    def evict_decode(self, obs: Observation, budget: int) -> None:
        self.evict_to_budget(obs, budget)
