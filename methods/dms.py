"""`dms`: threshold eviction over any scorer (kvpress DMSPress; the inference rule of Dynamic Memory Sparsification,
Łańcucki et al., 2025, arXiv:2506.05345, without its trained evictors).

`method=dms method.base=<scorer> method.threshold=X` (the base's options under `method.base_options`): the base
scores each token once, when it arrives (the prompt's tokens together after its last prefill chunk, a generated
token in its own decode step); a token whose score is below `threshold` is evicted as soon as it leaves the
sliding window of the sequence's `sliding_window_size` newest tokens (kvpress default 128). Nothing else is kept
or bounded: there is no budget, so how much stays depends on the input, and each run records it
(`kv_kept_fraction` in metrics.json and in every sample of samples.jsonl; kvbench-report draws the score against
it). `threshold` with `budget` or `compression_ratio` is refused (kvbench.run.spec.check_threshold).

As kvpress: scores are frozen at arrival (a token is judged by the score it got then, kvpress's scores_buffer);
per kv-head (heads keep different counts, and their tables really shrink: kvpress masks instead); no sinks.
Decoding (`decode`, kvpress's `decoding` flag): "none" (default: the prompt is compressed once, generated tokens
appended) or "evict" (each generated token is scored in its step and judged once it leaves the window).
A decode-step score of a base that ranks every cached token (snapkv, knorm, ...) is that base's score of the
new token in the step's cache, as kvpress passes the press only the new token's keys; KVzap's per-token
surrogate (`base=kvzap`) is the scorer DMS is built for.
prefill_mode "paper" (default) scores the prompt after its last chunk; "streaming" scores and judges each chunk as
it arrives. A question appended uncompressed (the query-agnostic protocol's `keep_uncompressed`) is never evicted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.base import Method, build_method, register_method
from kvbench.methods.scorer import check_interval
from kvbench.methods.checks import check_int
from kvbench.methods.selection import gather_aligned
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import LayerContext, Observation

FROZEN = "dms_scores"  # state key: [H, T] each cached token's score at arrival (+inf: never evicted)
SCORED = "dms_scored"  # state key: tokens of the sequence scored so far (by position)


@register_method("dms")
@dataclass
class DMS(ScorerWrapper):
    """Evict every token scored below `threshold` once it leaves the sliding window of the newest tokens."""

    needs_budget: ClassVar[bool] = False
    reselects_by_score: ClassVar[bool] = False  # a threshold rule (no decode="interval")
    base: str = "kvzap"  # the board's (kvpress kvzap_linear / kvzap_mlp)
    threshold: Optional[float] = None
    sliding_window_size: int = 128
    decode: str = "none"

    def __post_init__(self) -> None:
        if self.budget is not None or self.compression_ratio is not None:
            knob = f"budget={self.budget}" if self.budget is not None else f"compression_ratio={self.compression_ratio}"
            raise UserError(f"method.threshold and {knob} are both set: a threshold rule keeps what scores above "
                            "it (set budget=null compression_ratio=null) or use a budgeted method")
        t = self.threshold
        if t is None or isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(float(t)):
            raise UserError(f"invalid dms.threshold={t!r}: expected a finite number (tokens scored below it are "
                            f"evicted)")
        self.threshold = float(t)
        check_int(self.name, "sliding_window_size", self.sliding_window_size, 0)
        # ScorerWrapper's checks, with the base built to score only: compression_ratio 0.0 (it would keep every
        # token alone); the wrapper never calls its selection
        super(ScorerWrapper, self).__post_init__()
        self.check_base()
        self.inner = self.base if isinstance(self.base, Method) else build_method(
            self.base, None, compression_ratio=0.0, options_key="method.base_options", **dict(self.base_options))
        self.inner.run_under(self)  # one per-sequence state: the wrapper's
        check_interval(self)

    def tensor_parallel_refusal(self) -> str | None:
        return self.inner.tensor_parallel_refusal()

    # --- the driver: no budget, a threshold ----------------------------------------------------------
    def act(self, ctx: LayerContext) -> None:
        if ctx.phase == "decode" and self.decode == "none":
            return  # compressed after prefill only: generated tokens are appended
        for obs, _, held in self.sequences(ctx, 1):
            if held:  # a question appended uncompressed: scored +inf, never evicted
                self._freeze(obs, None)
            elif ctx.phase == "decode" or ctx.last_chunk or self.prefill_mode == "streaming":
                self._freeze(obs, self.inner.score(obs))
                self._evict_below(obs)
                if ctx.phase == "prefill" and ctx.last_chunk:
                    self._record_kept(obs)

    def _freeze(self, obs: Observation, scores: Optional[torch.Tensor]) -> None:
        """Give the tokens not scored yet their score at arrival (scores [H, T] of every cached slot; None: +inf)."""
        st = self.state(obs.slot, obs.layer)
        pos, valid = obs.positions, obs.valid  # [H, T]
        fresh = valid & (pos >= st.get(SCORED, 0))
        new = torch.full(pos.shape, float("inf"), device=pos.device) if scores is None else scores.float()
        old = st.get(FROZEN)
        if old is None:
            old = torch.zeros(pos.shape, device=pos.device)
        elif old.shape[-1] < pos.shape[-1]:
            old = torch.nn.functional.pad(old, (0, pos.shape[-1] - old.shape[-1]))
        st[FROZEN] = torch.where(fresh, new.to(old.device), old[:, : pos.shape[-1]])
        st[SCORED] = obs.tokens_seen

    def _evict_below(self, obs: Observation) -> None:
        """Keep every token inside the window of the newest sliding_window_size tokens or scored >= threshold."""
        st = self.state(obs.slot, obs.layer)
        pos, valid = obs.positions, obs.valid  # [H, T]
        keep = valid & ((pos >= obs.tokens_seen - self.sliding_window_size) | (st[FROZEN] >= self.threshold))
        if bool((keep == valid).all()):
            return
        T = pos.shape[-1]
        n = int(keep.sum(-1).max())
        slots = torch.arange(T, device=pos.device).expand_as(pos)
        order = torch.where(keep, slots, T + slots).sort(dim=-1).values[:, :max(n, 1)]  # kept slots first, sorted
        self.keep(obs, torch.where(order < T, order, torch.full_like(order, -1)))

    def keep(self, obs: Observation, keep: torch.Tensor) -> None:
        super().keep(obs, keep)
        st = self._state.get((obs.slot, obs.layer))
        if st is not None and st.get(FROZEN) is not None:
            st[FROZEN] = gather_aligned(st[FROZEN], keep)

    def evict_prefill(self, obs: Observation, budget: int) -> None:  # act() runs the threshold rule instead
        raise RuntimeError("dms evicts by threshold (act)")

    evict_decode = evict_prefill

    def table_budget(self, layer: int, head: int) -> int | None:
        return None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["eviction"] = "threshold"
        return d
