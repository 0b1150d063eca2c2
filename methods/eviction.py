"""When to evict: the driver every eviction method shares, and its per-(sequence, layer) state.

`EvictionMethod` is a mixin beside `Method` (`class MyMethod(EvictionMethod, Method)`; ScorerMethod and the
wrappers are such classes already). After each layer's attention it walks the step's sequences and, for each:
  1. decides the sequence's budget for the step (methods.budgets: `budget`, or `compression_ratio` of the prompt,
     plus tokens kept uncompressed) and hands it to the eviction as an argument;
  2. gathers an Observation (kvbench.runtime.contract) with what the method declared it reads: the observation
     window's queries (`query_window`), the accumulated attention (`accumulates_attention`), then calls `observe`;
  3. evicts, per the method's timing knobs:
       prefill_mode="paper"      attend over the whole prompt, evict once after its last prefill chunk
       prefill_mode="streaming"  evict after every prefill chunk (peak within budget + one chunk)
       decode="none"             compress after prefill only; generated tokens are appended, never evicted
       decode=<policy>           the method's own decode-time policy (its DECODE_POLICIES; its default is what its
                                 paper or official code does)
       decode="interval"         the one periodic policy (every scorer: ScorerMethod, ScorerWrapper): every
                                 `interval` decode steps a table over the budget is re-selected by its scores
     through `evict_prefill(obs, budget)` / `evict_decode(obs, budget)`, or, for a periodic policy, `reselect`
     once `decode_interval()` steps have passed (`evict_every`: R-KV's `buffer`, CaM's and DecodingPress's
     `compression_interval` are such intervals under their papers' names).
Per-sequence state: `state(slot, layer)` is a dict; a tensor under "scores" ([H, T], one column per cache slot) is
kept aligned with the cache's slots whenever `keep` drops tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.budgets import KeptStats, SequenceBudgets
from kvbench.methods.checks import check_choice
from kvbench.methods.observers import accumulate_attention, push_queries
from kvbench.methods.output_checks import check_keep
from kvbench.methods.selection import gather_aligned
from kvbench.runtime.contract import LayerContext, MethodCacheView, Observation

PREFILL_MODES = ("paper", "streaming")
INTERVAL = "interval"  # the periodic decode policy of every scorer (method.decode=interval method.interval=N)
DECODE_STEPS = "decode_steps"  # per-(sequence, layer) state: decode steps since the last periodic re-selection
HEAD_MODES = ("shared", "per_head")


@dataclass
class EvictionMethod:
    """The eviction driver (a mixin: list it before Method in the bases).

    `granularity` says how decoding evicts: "token" (the budget holds after every step) or "block" (whole blocks
    leave; the cache may run over the budget by at most the block that is filling). `budget_scope` says what the
    budget bounds once a method has evicted: "table" (every (layer, kv-head) table holds <= budget), "layer" (a
    layer's tables hold <= kv_heads x budget together: head-adaptive budgets) or "sequence" (all tables of a
    sequence hold <= layers x kv_heads x budget together).
    """

    granularity: ClassVar[str] = "token"
    needs_budget: ClassVar[bool] = True  # False: a threshold rule (methods.dms) bounds nothing by count
    budget_scope: ClassVar[str] = "table"
    evicts: ClassVar[bool] = True
    acts_after_attention: ClassVar[bool] = True
    accumulates_attention: ClassVar[bool] = False  # declared observation: obs.attention (H2O)
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("evict", "none")
    reselects_by_score: ClassVar[bool] = False  # True: decode="interval" is a choice too (evict_to_budget re-selects)
    # a periodic policy's due step that finds the tables within the budget: True, the count starts again
    # (DecodingPress); False, it goes on, so the next step is due too (kvpress's CAMPress)
    interval_restarts_within_budget: ClassVar[bool] = True
    prefill_mode: str = "paper"
    decode: str = "evict"

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.needs_budget and self.budget is None and self.compression_ratio is None:
            raise UserError(f"method {self.name!r} needs a budget: set budget=N (KV tokens kept per sequence, "
                            "layer and kv-head) or compression_ratio=R (fraction of each prompt's KV removed)")
        check_choice(self.name, "prefill_mode", self.prefill_mode, PREFILL_MODES)
        check_choice(self.name, "decode", self.decode, self.decode_policies())
        self._own_state: dict[tuple[int, int], dict[str, Any]] = {}
        self._state_owner: Optional[EvictionMethod] = None
        self._budgets = SequenceBudgets(self.budget, self.compression_ratio)
        self._kept = KeptStats()

    @classmethod
    def decode_policies(cls) -> tuple[str, ...]:
        """The `decode` choices: DECODE_POLICIES, and "interval" where the method re-selects by score."""
        interval = (INTERVAL,) if cls.reselects_by_score and INTERVAL not in cls.DECODE_POLICIES else ()
        return tuple(cls.DECODE_POLICIES) + interval

    @property
    def _state(self) -> dict[tuple[int, int], dict[str, Any]]:
        """Per-(sequence slot, layer) state: this method's own or, when it runs as a wrapper's base, its wrapper's
        (owned in one place: the driver that resets it, realigns it on eviction and drops it with the sequence)."""
        owner = self._state_owner
        return self._own_state if owner is None else owner._state

    def run_under(self, wrapper: "EvictionMethod") -> None:
        """This method is `wrapper`'s base from now on: the wrapper drives it, and its state is the wrapper's."""
        self._own_state.clear()
        self._state_owner = wrapper

    # --- declarations a method may override -------------------------------------------------------
    @property
    def needs_key_scores(self) -> bool:
        """The runtime flag behind `accumulates_attention`: the attention returns per-key mass."""
        return bool(self.accumulates_attention)

    @property
    def query_window(self) -> int:
        """Declared observation: how many of the latest queries obs.queries holds (0 = none)."""
        return 0

    def observes_in_decode(self) -> bool:
        """Whether the declared observations are gathered in the decode steps the method acts in (with
        decode="none" it acts in none)."""
        return True

    def min_budget(self) -> int:
        """The smallest budget a compression_ratio may give a sequence (the method's own minimum)."""
        return 1

    def decode_interval(self) -> int | None:
        """Decode steps between two re-selections under a periodic decode policy, or None (evict_decode runs
        every step). ScorerMethod and ScorerWrapper: `interval` with decode="interval"."""
        return None

    def over_budget(self, obs: Observation, budget: int) -> bool:
        """Whether obs's tables are over the budget (a table holds more than `budget` tokens)."""
        return int(obs.lengths.max()) > budget

    # --- the hook protocol ------------------------------------------------------------------------
    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)  # type: ignore[misc]
        self._state.clear()
        self._budgets.clear()

    @property
    def acts_before_attention(self) -> bool:
        """Whether prefill eviction runs before the layer's attention (the prompt then attends only to the kept
        tokens) instead of after it (the default); decode steps always act after it."""
        return False

    def before_attention(self, ctx: LayerContext) -> None:
        self.act(ctx)  # prefill steps only (the runtime calls it there)

    def after_attention(self, ctx: LayerContext) -> None:
        if not (self.acts_before_attention and ctx.phase == "prefill"):
            self.act(ctx)

    def sequences(self, ctx: LayerContext, min_budget: int) -> Iterator[tuple[Observation, Optional[int], bool]]:
        """The driver's walk over the step's sequences: (observation, budget, held) of each, its state reset on its
        first step and `observe` called; a held step (tokens appended uncompressed) is released after the last
        layer a method acts on."""
        cache = ctx.cache
        Q = ctx.plan.query_positions.shape[1]
        for i, slot in enumerate(ctx.plan.slot_list):
            seen = int(cache.tokens_seen[slot])
            if seen == Q:  # first step of the sequence now in this slot
                self._state.pop((slot, ctx.layer), None)
                if ctx.layer == cache.method_layers[0]:  # once per sequence (sliding layers see no method)
                    self._kept.forget(slot)
            budget, held = self._budgets.step(slot, seen, Q, ctx.phase, ctx.last_chunk, min_budget)
            obs = self.observation(ctx, i, slot)
            self.observe(obs)
            yield obs, budget, held
            if held and ctx.layer == cache.method_layers[-1]:
                self._budgets.release(slot)

    def act(self, ctx: LayerContext) -> None:
        """The driver, for each sequence of the step: its budget, its observation, then the eviction due."""
        if ctx.phase == "decode" and self.decode == "none":
            return  # compressed after prefill only: generated tokens are appended
        for obs, budget, held in self.sequences(ctx, self.min_budget()):
            if held:  # appended uncompressed: observed, never evicted in its own step
                continue
            if ctx.phase == "decode":
                interval = self.decode_interval()
                if interval is None:
                    self.evict_decode(obs, budget)
                else:
                    self.evict_every(obs, budget, interval)
            elif ctx.last_chunk or self.prefill_mode == "streaming":
                self.evict_prefill(obs, budget)
                if ctx.last_chunk:
                    self._record_kept(obs)

    def observation(self, ctx: LayerContext, i: int, slot: int) -> Observation:
        """The Observation of `slot` (row i) in ctx's layer, with the declared statistics updated and attached."""
        obs = Observation.of(ctx, i, slot, getattr(self, "model_config", None))
        window, attention = self.query_window, self.needs_key_scores
        if (window > 0 or attention) and (ctx.phase == "prefill" or self.observes_in_decode()):
            st = self.state(slot, ctx.layer)
            if window > 0:
                push_queries(st, obs, window)
            if attention:
                accumulate_attention(st, obs, self.name)
        st = self._state.get((slot, ctx.layer))
        if st:
            obs.queries, obs.query_positions, obs.attention = st.get("q"), st.get("q_pos"), st.get("scores")
        return obs

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        """The next step's `num_tokens` tokens of `slot` are not evicted in that step and raise its budget."""
        self._budgets.hold(slot, num_tokens)

    def on_sequence_end(self, slot: int) -> None:
        for key in [k for k in self._state if k[0] == slot]:
            del self._state[key]
        self._budgets.end(slot)

    def on_rollback(self, slot: int) -> None:
        """Speculative decoding cut `slot`'s tables back to fewer tokens (their newest slots went): the per-slot
        scores of the slots dropped go too (kvbench.runtime.serving.speculative.rollback calls this)."""
        for (s, layer), st in self._state.items():
            scores = st.get("scores") if s == slot else None
            if scores is None:
                continue
            lengths = self.cache.lengths[slot, layer].to(scores.device)  # [H]
            n = min(int(lengths.max()), scores.shape[-1])
            scores = scores[:, :n].clone()
            scores[torch.arange(n, device=scores.device)[None, :] >= lengths[:, None]] = 0
            st["scores"] = scores

    def on_fork(self, parent: int, child: int) -> None:
        """A forked sequence starts with a copy of its parent's per-layer state (scores, window queries)."""
        for (slot, layer), st in list(self._state.items()):
            if slot == parent:
                self._state[(child, layer)] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in st.items()}
        self._budgets.fork(parent, child)

    def evict_every(self, obs: Observation, budget: int, interval: int) -> None:
        """The one periodic decode-time policy (kvpress's DecodingPress): each (sequence, layer) counts its decode
        steps; at every `interval`-th one the count starts again and, if its tables are over the budget, `reselect`
        brings them back to it. A table thus holds at most budget + interval - 1 tokens after a step once compressed
        (decode_overshoot). A method with interval_restarts_within_budget False (CaM, as kvpress's CAMPress) keeps
        counting past a due step that finds its tables within the budget: every later step is due until one
        re-selects."""
        st = self.state(obs.slot, obs.layer)
        st[DECODE_STEPS] = st.get(DECODE_STEPS, 0) + 1
        if st[DECODE_STEPS] < interval:
            return
        if self.over_budget(obs, budget):
            self.reselect(obs, budget)  # reads the count (CaM merges as many tokens as steps passed)
        elif not self.interval_restarts_within_budget:
            return
        self.state(obs.slot, obs.layer)[DECODE_STEPS] = 0

    # --- what a method implements -----------------------------------------------------------------
    def reselect(self, obs: Observation, budget: int) -> None:
        """A periodic policy's re-selection of obs's tables (over the budget) down to it; ScorerMethod and
        ScorerWrapper keep the best by score (evict_to_budget), R-KV, CaM and DecodingPress their own."""
        self.evict_decode(obs, budget)

    def observe(self, obs: Observation) -> None:
        """Update statistics of the method's own from this step (the declared ones are already gathered)."""

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        raise NotImplementedError

    def evict_decode(self, obs: Observation, budget: int) -> None:
        raise NotImplementedError

    # --- figures ----------------------------------------------------------------------------------
    def _record_kept(self, obs: Observation) -> None:
        """After a prompt's compression of one layer: its prompt tokens and the tokens kept per kv-head."""
        self.record_kept(obs.cache, obs.slot, obs.layer)

    def record_kept(self, cache: Any, slot: int, layer: int) -> None:
        """prefill_stats' figures for one layer of `slot` once its prompt is compressed (a method that compresses
        after the step, as KVzip does, calls this itself and overrides _record_kept)."""
        self._kept.record(cache, slot, layer, self._budgets.extra(slot))

    def prompt_kept_fraction(self, slot: int) -> float | None:
        """The hook protocol's optional read at a sequence's first generated token: the fraction of its prompt's KV
        kept after compression (mean over layers and kv-heads), None before any compression of it."""
        return self._kept.fraction(slot)

    def prefill_totals(self) -> list:
        """The sums prefill_stats averages: tokens kept, prompt tokens, (prompt, layer) count (summed over the
        ranks of a data-parallel launch, then given back to prefill_stats)."""
        return list(self._kept.totals)

    def prefill_stats(self, totals: list | None = None) -> dict[str, Any]:
        """Tokens kept per (layer, kv-head) after each prompt's compression, averaged over every prompt, layer
        and kv-head compressed so far (`kv_tokens_kept_mean`), the prompts' mean length and the kept fraction
        (of `totals`, prefill_totals' sums, when given)."""
        return KeptStats.stats(self._kept.totals if totals is None else totals)

    def describe(self) -> dict[str, Any]:
        d = super().describe()  # type: ignore[misc]
        d["eviction"] = self.granularity
        return d

    # --- helpers ----------------------------------------------------------------------------------
    def table_budget(self, layer: int, head: int) -> int | None:
        """The most tokens table (layer, head) holds once evicted; None where no per-table bound applies (a
        head-adaptive method bounds the layer's total instead, see budget_scope)."""
        return self.budget if self.budget_scope == "table" else None

    def state(self, slot: int, layer: int) -> dict[str, Any]:
        return self._state.setdefault((slot, layer), {})

    def keep(self, obs: Observation, keep: torch.Tensor) -> None:
        """Token-level eviction of obs's layer: keep [H, n] sorted slots (-1 pads); realign state["scores"]."""
        check_keep(self, obs, keep)  # a wrong keep set names the method and the layer (methods.output_checks)
        obs.cache.keep_tokens(obs.layer, obs.slot, keep)
        obs.refresh()
        st = self._state.get((obs.slot, obs.layer))
        if st is not None and st.get("scores") is not None:
            st["scores"] = gather_aligned(st["scores"], keep)
            if obs.attention is not None:
                obs.attention = st["scores"]
