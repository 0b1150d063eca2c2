"""Behaviours by composition: a method over another scorer, held as an object (kvpress's AdaKVPress(press) shape).

`ScorerWrapper` holds its base, a plain scorer: `base` is an instance (`AdaKV(budget=64, base=MyKnorm(budget=64))`)
or a registered name, built with `base_options` and this method's budget or compression_ratio (`method=adakv
method.base=knorm` on the command line). The base observes every step and scores the tokens, the wrapper selects:
what the base declares (BASE_DECLARATIONS: its observation window, the attention it accumulates, its recent
window, its scores, its RoPE layout) is read from it through one descriptor, and its per-sequence state is the
wrapper's (EvictionMethod.run_under: the wrapper's driver resets it, realigns it on eviction and drops it with the
sequence). `head_adaptive` chooses the selection: per kv-head top-budget (False, the default, as the base alone)
or the layer's kv_heads x budget best (kv-head, token) pairs jointly (True: adakv, Ada-KV's allocation: heads keep
different numbers of tokens and hold different numbers of blocks; each head first keeps its recent window and its
`min_tokens_per_head(budget)` best ones). decode="interval" with interval=N re-selects every N decode steps.

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
from kvbench.methods.eviction import INTERVAL, EvictionMethod
from kvbench.methods.scorer import ScorerMethod, check_interval
from kvbench.methods.selection import top_tokens, top_tokens_in_layer
from kvbench.runtime.contract import (MethodCacheView, Observation, full_kv_heads, gather_head_scores, local_keep,
                                      sum_over_ranks, tp_size_of)


def is_plain_scorer(cls: type) -> bool:
    """Whether `cls` scores tokens and keeps the top ones (ScorerMethod's own selection)."""
    return issubclass(cls, ScorerMethod) and cls.select is ScorerMethod.select


def plain_scorers() -> list[str]:
    """Registered plain scorers: the methods a wrapper (adakv, criticalkv) may take as its `base` by name."""
    return sorted(n for n in METHODS.names() if is_plain_scorer(METHODS[n]))


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


class FromBase:
    """A declaration a wrapper reads from its base (`self.inner`): an attribute, a property or a method. The one
    mechanism by which a wrapper delegates (BASE_DECLARATIONS); a subclass that defines the name itself wins."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj.inner, self.name)


# What a wrapper takes from its base as it is: the observations the base declares (the driver gathers them into
# the shared state), its scores and their scale, its protected recent window, and where its keys are cached.
BASE_DECLARATIONS = ("needs_key_scores", "query_window", "store_pre_rope", "reads_hidden_states", "rope_mode",
                     "recent_window", "score", "score_scale")


@dataclass
class ScorerWrapper(EvictionMethod, Method):
    """A method over another scoring method: the base scores, the wrapper (re-weights and) selects."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    reselects_by_score: ClassVar[bool] = True
    head_adaptive: ClassVar[bool] = False  # True: the layer's kv_heads x budget best pairs (Ada-KV)
    decode: str = "none"
    base: Any = "snapkv"  # a plain scorer: a registered name, or an instance (its own budget is not read)
    base_options: dict = field(default_factory=dict)
    interval: Optional[int] = None  # decode="interval": decode steps between two re-selections

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_base()
        if isinstance(self.base, Method):
            self.inner = self.base
        else:
            ratio = getattr(self, "compression_ratio", None)  # the base gets the same knob as the wrapper
            knob = {} if ratio is None else {"compression_ratio": ratio}
            self.inner = build_method(self.base, self.budget, **knob, options_key="method.base_options",
                                      **dict(self.base_options))
        self.inner.run_under(self)  # one per-sequence state: the wrapper's
        check_interval(self)

    def base_name(self) -> str:
        """The base's registered name (`base` as given, or the instance's)."""
        return self.base.name if isinstance(self.base, Method) else self.base

    def check_base(self) -> None:
        """UserError (one line) unless `base` is a plain scorer (by name or instance) and `base_options` a mapping
        (empty for an instance: its options are its own)."""
        bases = plain_scorers()
        if isinstance(self.base, Method):
            if not is_plain_scorer(type(self.base)):
                raise UserError(f"invalid {self.name}.base={type(self.base).__name__}: a plain scorer (a ScorerMethod "
                                f"keeping its own selection) is wrapped, such as {', '.join(bases[:4])}, ...")
            if self.base_options:
                raise UserError(f"invalid {self.name}.base_options={self.base_options!r}: the base is given as an "
                                "object, which holds its own options")
            return
        if self.base not in bases:
            raise UserError(f"invalid {self.name}.base={self.base!r}: choose one of {', '.join(bases)}")
        if not isinstance(self.base_options, dict):
            raise UserError(f"invalid {self.name}.base_options={self.base_options!r}: expected a mapping of "
                            f"{self.base}'s options")

    # --- what the wrapper's selection implies -----------------------------------------------------

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "layer" if self.head_adaptive else "table"

    def observes_in_decode(self) -> bool:
        """The base observes decode steps where it would alone, and wherever a periodic policy re-scores."""
        return self.decode_interval() is not None or self.inner.observes_in_decode()

    def decode_interval(self) -> int | None:
        return self.interval if self.decode == INTERVAL else None

    def decode_overshoot(self) -> int:
        """Tokens a table may hold over the budget after a decode step, once compressed (the interval's)."""
        interval = self.decode_interval()
        return 0 if interval is None else max(0, interval - 1)

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        self.inner.attach(cache, model_config)

    def bind_engine(self, engine: Any) -> None:
        """The engine this method runs in (the hook protocol's optional `bind_engine`): model weights."""
        self.engine = engine
        self.inner.bind_engine(engine)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["base"] = self.inner.name
        d["base_settings"] = {k: v for k, v in self.inner.describe().items() if k != "budget"}
        return d

    # --- the base observes and scores; the wrapper selects -----------------------------------------
    def observe(self, obs: Observation) -> None:
        self.inner.observe(obs)

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

    def over_budget(self, obs: Observation, budget: int) -> bool:
        return layer_over_budget(obs, budget) if self.head_adaptive else int(obs.lengths.max()) > budget

    def evict_to_budget(self, obs: Observation, budget: int) -> None:
        if self.over_budget(obs, budget):
            self.keep(obs, self.select(obs, budget))

    def reselect(self, obs: Observation, budget: int) -> None:
        """decode="interval": the wrapper's selection (the newest token kept)."""
        self.evict_to_budget(obs, budget)

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        self.evict_to_budget(obs, budget)

    def evict_decode(self, obs: Observation, budget: int) -> None:
        self.evict_to_budget(obs, budget)


for _name in BASE_DECLARATIONS:  # one descriptor each; a subclass's own definition overrides it
    setattr(ScorerWrapper, _name, FromBase(_name))
