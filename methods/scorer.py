"""The method contract: a scorer is one `score(obs) -> [H_kv, T]` (higher = keep); selection, budgets, timing and
state are inherited.

    from kvbench.methods import ScorerMethod, register_method

    @register_method("my_knorm")
    @dataclass
    class MyKnorm(ScorerMethod):
        def score(self, obs):
            return -obs.keys.norm(dim=-1)

`obs` is a kvbench.runtime.contract.Observation: keys, values, positions, lengths of the sequence's tables in the
layer, and what the method declares it reads (`query_window` -> obs.queries, `accumulates_attention` ->
obs.attention). The defaults are kvpress's ScorerPress: the prompt is compressed once after prefill (decode="none")
and each kv-head keeps its `budget` best tokens by score alone; decode="evict" re-selects after every decode step,
keeping the newest token; decode="interval" with interval=N re-selects every N decode steps (kvpress's
DecodingPress over this scorer, without its prompt left whole: methods.eviction.EvictionMethod.evict_every).
Behaviours come by wrapping a scorer (methods.wrappers: head-adaptive budgets, CriticalKV, a wrapper of one's own)
or by the options every eviction method has (prefill_mode, decode; methods.eviction).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from kvbench.methods.base import Method
from kvbench.errors import UserError
from kvbench.methods.checks import check_int
from kvbench.methods.eviction import INTERVAL, EvictionMethod
from kvbench.methods.output_checks import check_scores
from kvbench.methods.selection import top_tokens
from kvbench.runtime.contract import Observation


@dataclass
class ScorerMethod(EvictionMethod, Method):
    """Token-level eviction by a score: implement `score(obs)`; the selection is inherited.

    Whenever a table holds more than the sequence's budget, each kv-head keeps its last `recent_window(budget)`
    tokens plus its best-scoring ones. At prefill a method with `keeps_newest_at_prefill` keeps at least the newest
    token too (SnapKV, H2O, TOVA); kvpress's scorers (the default) rank the prompt by score alone.
    """

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every score() a subclass defines is checked where the runtime receives it (methods.output_checks)."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("score")
        if callable(own) and not getattr(own, "_checked", False):
            cls.score = _checked(own)  # type: ignore[method-assign]
    keeps_newest_at_prefill: ClassVar[bool] = False
    reselects_by_score: ClassVar[bool] = True
    decode: str = "none"
    interval: Optional[int] = None  # decode="interval": decode steps between two re-selections

    def __post_init__(self) -> None:
        super().__post_init__()
        check_interval(self)

    def decode_interval(self) -> int | None:
        return self.interval if self.decode == INTERVAL else None

    def decode_overshoot(self) -> int:
        """Tokens a table may hold over the budget after a decode step, once compressed (the interval's)."""
        interval = self.decode_interval()
        return 0 if interval is None else max(0, interval - 1)

    def score(self, obs: Observation) -> torch.Tensor:
        """Importance [H, T] of every cached token of obs's layer (higher = keep)."""
        raise NotImplementedError(f"method {self.name!r} implements no score(obs)")

    def recent_window(self, budget: int) -> int:
        """Slots at the end of each table always kept (counted in the budget)."""
        return 0

    def score_scale(self, obs: Observation) -> float:
        """The factor that puts score()'s values on kvpress's scale (its press's score()). The selection only ranks,
        so it never needs it; a wrapper that adds a constant to the scores does (criticalkv's epsilon)."""
        return 1.0

    def recent_kept(self, obs: Observation, budget: int) -> int:
        """Slots at the end of each table kept before any by score: the recent window, at least the newest token
        (a recent window of 0 would otherwise evict each generated token right after its own step)."""
        return min(max(1, self.recent_window(budget)), budget)

    def select(self, obs: Observation, budget: int) -> torch.Tensor:
        """Keep set [H, budget] (sorted slots) for a table over budget: the recent_kept() slots, then by score."""
        return top_tokens(self.score(obs), budget, obs.lengths, recent=self.recent_kept(obs, budget))

    def evict_to_budget(self, obs: Observation, budget: int) -> None:
        if int(obs.lengths.max()) > budget:
            self.keep(obs, self.select(obs, budget))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        if self.keeps_newest_at_prefill:
            return self.evict_to_budget(obs, budget)
        lengths = obs.lengths  # [H]
        if int(lengths.max()) > budget:  # kvpress: the prompt by score alone
            self.keep(obs, top_tokens(self.score(obs), budget, lengths))

    def evict_decode(self, obs: Observation, budget: int) -> None:
        self.evict_to_budget(obs, budget)

    def reselect(self, obs: Observation, budget: int) -> None:
        """decode="interval": the inherited selection, by score (the newest token kept)."""
        self.evict_to_budget(obs, budget)


def check_interval(method: Any) -> None:
    """UserError (one line) for an `interval` that is not a positive integer, missing under decode="interval", or
    set where no decode policy reads it."""
    if method.interval is not None:
        check_int(method.name, "interval", method.interval, 1)
        if method.decode != INTERVAL:
            raise UserError(f"method.interval={method.interval} is read only with method.decode=interval (method "
                            f"{method.name!r} has decode={method.decode})")
    elif method.decode == INTERVAL and method.decode_interval() is None:
        raise UserError(f"method {method.name!r} decode=interval needs method.interval=N (decode steps between two "
                        f"re-selections)")


def _checked(score: Callable) -> Callable:
    """score(obs), its output checked: [H_kv, T] real numbers on the cache's device, no NaN (MethodOutputError names
    the method and the layer otherwise)."""

    @functools.wraps(score)
    def checked_score(self: Any, obs: Observation) -> torch.Tensor:
        return check_scores(self, obs, score(self, obs))

    checked_score._checked = True  # type: ignore[attr-defined]
    return checked_score
