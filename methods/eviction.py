"""Shared machinery of the eviction methods: when to evict, per-sequence state, top-k selection.

`EvictionMethod` decides *when* a method evicts:
  prefill_mode="paper"      attend over the whole prompt, evict once after its last prefill chunk
  prefill_mode="streaming"  evict after every prefill chunk (peak within budget + one chunk)
  decode="none"             compress after prefill only; generated tokens are appended, never evicted
  decode=<policy>           the method's own decode-time policy (each method lists its choices in
                            DECODE_POLICIES; its default is what its paper or official code does)
and keeps per-(sequence slot, layer) state; a tensor stored under state["scores"] ([H, T], one column
per cache slot) is kept aligned with the cache's slots whenever tokens are dropped.

The budget of a sequence is decided here, once for every method (`EvictionMethod.sequence_budget`): while a
method's hooks run for a sequence, `self.budget` is that sequence's budget:
  budget=N                 N
  compression_ratio=r      int(P * (1 - r)) (kvpress's n_kept), P = the prompt's tokens, known when its last
                           prefill chunk has been written (so with a ratio, prefill evicts once, at that chunk,
                           whatever `prefill_mode`); at least `min_budget()`; fixed from then on while decoding
  + uncompressed tokens    tokens appended through `keep_uncompressed` (a question after its compressed context)
                           are never evicted in their own step and add to the sequence's budget.

`ScoreEvictionMethod` (token level): subclasses implement `score()` -> [H, T] (higher = keep) and
`recent_window()`; the base keeps, per kv-head, the recent window plus the best-scoring tokens.

`BlockScoreEvictionMethod` (PagedEviction-style): subclasses implement `token_scores(k, v)`; prefill
evicts tokens down to the budget, decoding drops the lowest-scoring whole block when the newest
block fills and the cache exceeds the budget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.base import Method
from kvbench.methods.base import METHODS
from kvbench.runtime.contract import MethodCacheView
from kvbench.runtime.contract import LayerContext
from kvbench.runtime.contract import full_kv_heads, gather_head_scores, local_keep, sum_over_ranks, tp_size_of

PREFILL_MODES = ("paper", "streaming")
HEAD_MODES = ("shared", "per_head")


# ---------------------------------------------------------------------------- validation helpers
def check_choice(method: str, option: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"invalid {method}.{option}={value!r}: choose one of {', '.join(choices)}")


def check_int(method: str, option: str, value: Any, lo: int, hi: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UserError(f"invalid {method}.{option}={value!r}: expected an integer {rng}")


def check_float(method: str, option: str, value: Any, lo: float, hi: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= float(value) <= hi
    if not ok:
        raise UserError(f"invalid {method}.{option}={value!r}: expected a number in [{lo}, {hi}]")


def check_bool(method: str, option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"invalid {method}.{option}={value!r}: expected true or false")


# ---------------------------------------------------------------------------- selection helpers
def sort_keep(idx: torch.Tensor, size: int) -> torch.Tensor:
    """idx [H, n] slot indices (-1 = none) -> sorted ascending per row, -1 pads moved to the end."""
    big = torch.where(idx < 0, torch.full_like(idx, size), idx)
    out = big.sort(dim=-1).values
    return torch.where(out >= size, torch.full_like(out, -1), out)


def valid_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """lengths [H] -> [H, T] True where slot t holds a token."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def top_tokens(scores: torch.Tensor, k: int, lengths: torch.Tensor, *, recent: int = 0, sinks: int = 0) -> torch.Tensor:
    """Keep set [H, min(k, T)] (sorted slot indices, -1 pads) of the k best tokens per head.

    scores [H, T] (higher = keep); lengths [H] valid slots per head. The last `recent` and the first
    `sinks` slots of each head are kept first (they count towards k).
    """
    H, T = scores.shape
    k = min(k, T)
    if k <= 0:
        return torch.empty(H, 0, dtype=torch.int64, device=scores.device)
    valid = valid_mask(lengths, T)
    s = scores.float().masked_fill(~valid, float("-inf"))
    ar = torch.arange(T, device=scores.device)[None, :]
    protect = torch.zeros_like(valid)
    if recent > 0:
        protect |= ar >= (lengths[:, None] - recent)
    if sinks > 0:
        protect |= ar < sinks
    s = s.masked_fill(protect & valid, float("inf"))
    idx = s.topk(k, dim=-1).indices  # [H, k]
    idx = torch.where(valid.gather(-1, idx), idx, torch.full_like(idx, -1))
    return sort_keep(idx, T)


def top_tokens_in_layer(scores: torch.Tensor, total: int, lengths: torch.Tensor, *, recent: int = 0,
                        min_per_head: int = 0) -> torch.Tensor:
    """Head-adaptive keep set [H, n] (sorted slot indices, -1 pads; n = the most any head keeps) of one layer.

    The `total` best (kv-head, token) pairs of the layer are chosen jointly over all its heads (Ada-KV's budget
    allocation), so heads keep different numbers of tokens. scores [H, T] (higher = keep); lengths [H] valid
    slots per head. Each head first keeps its last `recent` slots and its `min_per_head` best tokens (Ada-KV's
    safeguard); these count towards `total`, which must cover them (H * max(recent, min_per_head) <= total).
    """
    H, T = scores.shape
    valid = valid_mask(lengths, T)
    total = min(total, int(lengths.sum()))
    # a score of +inf from the scorer (e.g. SnapKV's window) ranks below the protected slots
    s = scores.float().clamp(max=torch.finfo(torch.float32).max).masked_fill(~valid, float("-inf"))
    protect = torch.zeros_like(valid)
    if recent > 0:
        protect |= torch.arange(T, device=scores.device)[None, :] >= (lengths[:, None] - recent)
    if min_per_head > 0:
        best = s.topk(min(min_per_head, T), dim=-1).indices  # [H, m]
        protect.scatter_(-1, best, True)
    s = s.masked_fill(protect & valid, float("inf"))
    flat = s.reshape(-1).topk(total).indices  # [total] over H*T
    chosen = torch.zeros(H * T, dtype=torch.bool, device=scores.device)
    chosen[flat] = True
    chosen = chosen.view(H, T) & valid
    n = int(chosen.sum(-1).max()) if total > 0 else 0
    # the chosen slots of each head, in slot order, padded with -1: sort (not chosen) last, stable
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)[:, :n]  # [H, n]
    return torch.where(chosen.gather(-1, order), order, torch.full_like(order, -1))


def gather_aligned(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Per-slot values [H, T] -> [H, n] following keep [H, n] (-1 pads give 0)."""
    out = values.gather(-1, keep.clamp(min=0))
    return out.masked_fill(keep < 0, 0)


def window_attention_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                            lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass each key receives from a window of queries, summed per kv-head (SnapKV).

    q [Hq, W, D] (as used by attention), q_pos [W]; k [H, T, D] (post-RoPE, as cached), k_pos [H, T];
    lengths [H]. Softmax over the cached keys a query may see (causal by original position); the
    probabilities are summed over the window and over the query heads of each kv-head -> [H, T].
    """
    Hq, W, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    qg = q.reshape(H, G * W, D).to(k.dtype)
    logits = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [H, G*W, T]
    qp = q_pos.repeat(G)  # [G*W] (query-head-major, like qg)
    vis = (k_pos[:, None, :] <= qp[None, :, None]) & valid_mask(lengths, T)[:, None, :]
    probs = torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
    return torch.nan_to_num(probs, nan=0.0).sum(dim=1)  # [H, T]


POOLINGS = ("avgpool", "maxpool")


def pool_tokens(scores: torch.Tensor, kernel: int, pooling: str = "avgpool") -> torch.Tensor:
    """Pool [H, T] along tokens with an odd kernel, stride 1, same length (SnapKV's clustering).

    avgpool is the official code's default (F.avg_pool1d, zero padding counted, as in SnapKV and kvpress)."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    return pool(scores[:, None, :], kernel_size=kernel, stride=1, padding=kernel // 2)[:, 0, :]


# ---------------------------------------------------------------------------- bases
@dataclass
class EvictionMethod(Method):
    """Base of the eviction methods: when to evict (prefill mode, decode) and per-sequence state.

    `granularity` says how decoding evicts: "token" (the budget holds after every step) or "block"
    (whole blocks leave; the cache may run over the budget by at most the block that is filling).
    """

    granularity: ClassVar[str] = "token"
    # What the budget bounds once a method has evicted: "table" (every (layer, kv-head) table holds <= budget),
    # "layer" (a layer's tables hold <= kv_heads x budget together, split unevenly: head-adaptive budgets) or
    # "sequence" (all tables of a sequence hold <= layers x kv_heads x budget together).
    budget_scope: ClassVar[str] = "table"
    evicts: ClassVar[bool] = True
    acts_after_attention: ClassVar[bool] = True
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("evict", "none")
    prefill_mode: str = "paper"
    decode: str = "evict"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget is None and self.compression_ratio is None:
            raise UserError(f"method {self.name!r} needs a budget: set budget=N (KV tokens kept per sequence, "
                            "layer and kv-head) or compression_ratio=R (fraction of each prompt's KV removed)")
        check_choice(self.name, "prefill_mode", self.prefill_mode, PREFILL_MODES)
        check_choice(self.name, "decode", self.decode, self.DECODE_POLICIES)
        self._state: dict[tuple[int, int], dict[str, Any]] = {}
        self._configured_budget = self.budget  # None with a compression_ratio
        # slot -> {"prompt": budget from the prompt (ratio) or None, "extra": uncompressed tokens, "hold": tokens of
        # the step being appended uncompressed (0 = none)}
        self._sequences: dict[int, dict[str, Any]] = {}
        self._kept = [0.0, 0, 0]  # sum of tokens kept per kv-head, sum of prompt tokens, (prompt, layer) count

    # --- runtime points ------------------------------------------------------------------
    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        self._state.clear()
        self._sequences.clear()

    def after_attention(self, ctx: LayerContext) -> None:
        if ctx.phase == "decode" and self.decode == "none":
            return  # compressed after prefill only: generated tokens are appended
        cache = ctx.cache
        Q = ctx.plan.query_positions.shape[1]
        try:
            for i, slot in enumerate(ctx.plan.slot_list):
                if cache.tokens_seen[slot] == Q:  # first step of the sequence now in this slot
                    self._state.pop((slot, ctx.layer), None)
                held = self.sequence_budget(ctx, slot, Q)
                self.observe(ctx, i, slot)
                if held:  # appended uncompressed: observed, never evicted in its own step
                    if ctx.layer == cache.num_layers - 1:
                        self._sequences[slot]["hold"] = 0
                elif ctx.phase == "decode":
                    self.evict_decode(ctx, i, slot)
                elif ctx.last_chunk or self.prefill_mode == "streaming":
                    self.evict_prefill(ctx, i, slot)
                    if ctx.last_chunk:
                        self._record_kept(ctx, slot)
        finally:
            self.budget = self._configured_budget

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        """The next step's `num_tokens` tokens of `slot` are not evicted in that step and raise its budget."""
        seq = self._sequences.setdefault(slot, {"prompt": None, "extra": 0, "hold": 0})
        seq["hold"] = int(num_tokens)
        seq["extra"] += int(num_tokens)

    def sequence_budget(self, ctx: LayerContext, slot: int, Q: int) -> bool:
        """Set `self.budget` to `slot`'s budget for this step (see the module docstring: the one place where
        `budget` or `compression_ratio` becomes a sequence's budget); True when this step is held uncompressed."""
        seen = int(ctx.cache.tokens_seen[slot])
        seq = self._sequences.setdefault(slot, {"prompt": None, "extra": 0, "hold": 0})
        if seen == Q and not seq["hold"]:  # the first step of the sequence now in this slot
            seq.update(prompt=None, extra=0)
        held = bool(seq["hold"]) and seq["hold"] == Q and ctx.phase == "prefill"
        if self.compression_ratio is None:
            self.budget = self._configured_budget + seq["extra"]
            return held
        if ctx.phase == "prefill" and ctx.last_chunk and not held:
            compressible = seen - seq["extra"]  # prompt tokens (a held question is not compressed)
            seq["prompt"] = max(self.min_budget(), int(compressible * (1.0 - self.compression_ratio)))
        # before the prompt's last chunk nothing is evicted: the budget is every token seen
        self.budget = seen if seq["prompt"] is None else seq["prompt"] + seq["extra"]
        return held

    def min_budget(self) -> int:
        """The smallest budget a compression_ratio may give a sequence (the method's own minimum)."""
        return 1

    def _record_kept(self, ctx: LayerContext, slot: int) -> None:
        """After a prompt's compression of one layer: its prompt tokens and the tokens kept per kv-head."""
        self.record_kept(ctx.cache, slot, ctx.layer)

    def record_kept(self, cache: Any, slot: int, layer: int) -> None:
        """prefill_stats' figures for one layer of `slot` once its prompt is compressed (a method that compresses
        after the step, as KVzip does, calls this itself and overrides _record_kept)."""
        seq = self._sequences.get(slot, {})
        prompt = int(cache.tokens_seen[slot]) - int(seq.get("extra", 0))
        kept = float(cache.lengths[slot, layer].float().mean())  # mean over kv-heads
        self._kept[0] += kept
        self._kept[1] += prompt
        self._kept[2] += 1

    def prefill_totals(self) -> list:
        """The sums prefill_stats averages: tokens kept, prompt tokens, (prompt, layer) count (summed over the
        ranks of a data-parallel launch, then given back to prefill_stats)."""
        return list(self._kept)

    def prefill_stats(self, totals: list | None = None) -> dict[str, Any]:
        """Tokens kept per (layer, kv-head) after each prompt's compression, averaged over every prompt, layer
        and kv-head compressed so far (`kv_tokens_kept_mean`), the prompts' mean length and the kept fraction
        (of `totals`, prefill_totals' sums, when given)."""
        kept, prompt, n = self._kept if totals is None else totals
        if not n:
            return {"kv_tokens_kept_mean": None, "prompt_tokens_mean": None, "kv_kept_fraction": None}
        return {"kv_tokens_kept_mean": round(kept / n, 2), "prompt_tokens_mean": round(prompt / n, 2),
                "kv_kept_fraction": round(kept / prompt, 4) if prompt else None}

    def on_sequence_end(self, slot: int) -> None:
        for key in [k for k in self._state if k[0] == slot]:
            del self._state[key]
        self._sequences.pop(slot, None)

    def on_rollback(self, slot: int) -> None:
        """Speculative decoding cut `slot`'s tables back to fewer tokens (their newest slots went): the per-slot
        scores of the slots dropped go too (kvbench.runtime.speculative.rollback calls this)."""
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
        if parent in self._sequences:
            self._sequences[child] = dict(self._sequences[parent])

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["eviction"] = self.granularity
        return d

    # --- what subclasses implement ---------------------------------------------------------
    def observe(self, ctx: LayerContext, i: int, slot: int) -> None:
        """Update per-sequence statistics from this step (i = row of `slot` in the batch)."""

    def evict_prefill(self, ctx: LayerContext, i: int, slot: int) -> None:
        raise NotImplementedError

    def evict_decode(self, ctx: LayerContext, i: int, slot: int) -> None:
        raise NotImplementedError

    # --- helpers ---------------------------------------------------------------------------
    def table_budget(self, layer: int, head: int) -> int | None:
        """The most tokens table (layer, head) holds once evicted; None where no per-table bound applies (a
        head-adaptive method bounds the layer's total instead, see budget_scope)."""
        return self.budget if self.budget_scope == "table" else None

    def state(self, slot: int, layer: int) -> dict[str, Any]:
        return self._state.setdefault((slot, layer), {})

    def keep(self, ctx: LayerContext, slot: int, keep: torch.Tensor) -> None:
        """Token-level eviction of ctx.layer: keep [H, n] sorted slots (-1 pads); realign state["scores"]."""
        ctx.cache.keep_tokens(ctx.layer, slot, keep)
        st = self._state.get((slot, ctx.layer))
        if st is not None and st.get("scores") is not None:
            st["scores"] = gather_aligned(st["scores"], keep)

    def accumulate_key_scores(self, ctx: LayerContext, i: int, slot: int) -> None:
        """H2O statistics: add this step's attention mass per key slot to state["scores"] [H, T]."""
        if ctx.key_scores is None:
            raise RuntimeError(f"{self.name}: the runtime gave no key_scores (needs_key_scores is set)")
        n = max(ctx.plan.table_lengths(i, ctx.layer))  # observed before this layer evicts: still exact
        st = self.state(slot, ctx.layer)
        ks = ctx.key_scores[i, :, :n].float()  # [H, n]
        acc = st.get("scores")
        if acc is None:
            acc = torch.zeros_like(ks)
        elif acc.shape[-1] < n:
            acc = F.pad(acc, (0, n - acc.shape[-1]))
        st["scores"] = acc + ks

    def push_queries(self, ctx: LayerContext, i: int, slot: int, window: int) -> None:
        """SnapKV statistics: keep the last `window` queries [Hq, W, D] and their positions [W]."""
        st = self.state(slot, ctx.layer)
        q = ctx.q[i]  # [Hq, Q, D]
        pos = ctx.plan.query_positions[i]  # [Q]
        if "q" in st:
            q = torch.cat([st["q"], q], dim=1)
            pos = torch.cat([st["q_pos"], pos])
        st["q"], st["q_pos"] = q[:, -window:].clone(), pos[-window:].clone()

    def snapkv_scores(self, ctx: LayerContext, slot: int, window: int, kernel: int,
                      pooling: str = "avgpool") -> torch.Tensor:
        """SnapKV importance [H, T]: window-query attention summed over the window and the query heads of each
        kv-head, pooled over the tokens before the window (the window's own columns are +inf: always kept).
        Summing a GQA group before pooling ranks like averaging it; with avgpool the order of pooling and
        group aggregation does not matter, with maxpool the group is aggregated first."""
        cache = ctx.cache
        if cache.store_pre_rope:
            raise UserError(f"method {self.name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        st = self.state(slot, ctx.layer)
        k, _, k_pos = cache.gather(ctx.layer, slot)  # [H, T, D], [H, T]
        lengths = cache.lengths[slot, ctx.layer]
        T = k.shape[1]
        s = window_attention_scores(st["q"], st["q_pos"], k, k_pos, lengths, ctx.q.shape[-1] ** -0.5)
        w = min(window, T)
        out = torch.full_like(s, float("inf"))
        out[:, : T - w] = pool_tokens(s[:, : T - w], kernel, pooling)
        return out


@dataclass
class ScoreEvictionMethod(EvictionMethod):
    """Token-level eviction by a score: implement `score()`; the selection is inherited.

    Whenever a table holds more than `budget` tokens (prefill per `prefill_mode`, every decode
    step), each kv-head keeps its last `recent_window()` tokens plus its best-scoring ones.
    """

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        """Importance [H, T] of every cached token of ctx.layer (higher = keep)."""
        raise NotImplementedError

    def recent_window(self) -> int:
        return 0

    def score_scale(self, ctx: LayerContext, slot: int) -> float:
        """The factor that puts score()'s values on kvpress's scale (its press's score()). The selection only ranks,
        so it never needs it; a wrapper that adds a constant to the scores does (criticalkv's epsilon)."""
        return 1.0

    def recent_kept(self, ctx: LayerContext) -> int:
        """Slots at the end of each table kept before any by score: the recent window, at least the newest token
        (a recent window of 0 would otherwise evict each generated token right after its own step)."""
        return min(max(1, self.recent_window()), self.budget)

    def select(self, ctx: LayerContext, i: int, slot: int, lengths: torch.Tensor) -> torch.Tensor:
        """Keep set [H, budget] (sorted slots) for a table over budget: the recent_kept() slots, then by score."""
        return top_tokens(self.score(ctx, i, slot), self.budget, lengths, recent=self.recent_kept(ctx))

    def evict_to_budget(self, ctx: LayerContext, i: int, slot: int) -> None:
        lengths = ctx.cache.lengths[slot, ctx.layer]  # [H]
        if int(lengths.max()) > self.budget:
            self.keep(ctx, slot, self.select(ctx, i, slot, lengths))

    def evict_prefill(self, ctx: LayerContext, i: int, slot: int) -> None:
        self.evict_to_budget(ctx, i, slot)

    def evict_decode(self, ctx: LayerContext, i: int, slot: int) -> None:
        self.evict_to_budget(ctx, i, slot)


@dataclass
class HeadAdaptiveEvictionMethod(ScoreEvictionMethod):
    """Token-level eviction by a score with head-adaptive budgets (Ada-KV's allocation).

    A layer whose tables hold more than kv_heads x budget tokens in all keeps the kv_heads x budget best
    (kv-head, token) pairs chosen jointly over its heads, so its kv-heads keep different numbers of tokens (and
    hold different numbers of blocks: the cache frees each table's emptied blocks). Each head keeps its last
    `recent_window()` tokens and its `min_tokens_per_head()` best ones first.

    On a model sharded by kv-head (runtime.tensor_parallel), the joint choice ranks every kv-head of the layer, so
    each rank gathers the others' scores (one all-gather per eviction) and keeps its own heads' share of the result;
    whether a layer is over its budget is summed over the ranks (one all-reduce), so every rank decides alike.
    """

    budget_scope: ClassVar[str] = "layer"

    def min_tokens_per_head(self) -> int:
        return 0

    def select(self, ctx: LayerContext, i: int, slot: int, lengths: torch.Tensor) -> torch.Tensor:
        scores, cfg = self.score(ctx, i, slot), getattr(self, "model_config", None)
        if tp_size_of(cfg) > 1:  # rank the (kv-head, token) pairs of every rank's heads
            scores, lengths = gather_head_scores(scores, lengths, cfg, int(ctx.cache.tokens_seen[slot]))
        keep = top_tokens_in_layer(scores, lengths.shape[0] * self.budget, lengths,
                                   recent=self.recent_kept(ctx), min_per_head=self.min_tokens_per_head())
        return local_keep(keep, cfg) if tp_size_of(cfg) > 1 else keep

    def evict_to_budget(self, ctx: LayerContext, i: int, slot: int) -> None:
        lengths = ctx.cache.lengths[slot, ctx.layer]  # [H]
        held, heads, cfg = sum(ctx.plan.table_lengths(i, ctx.layer)), lengths.shape[0], getattr(self, "model_config", None)
        if tp_size_of(cfg) > 1:  # the layer's tables on every rank
            held, heads = sum_over_ranks(held, cfg, lengths.device), full_kv_heads(cfg)
        if held > heads * self.budget:
            self.keep(ctx, slot, self.select(ctx, i, slot, lengths))


def plain_scorers() -> list[str]:
    """Registered methods that score tokens and keep the top ones (ScoreEvictionMethod's own selection): the
    methods a wrapper (adakv, criticalkv) may take as its `base`."""
    return sorted(n for n in METHODS.names()
                  if issubclass(METHODS[n], ScoreEvictionMethod) and not issubclass(METHODS[n], ScorerWrapper)
                  and METHODS[n].select in (ScoreEvictionMethod.select, HeadAdaptiveEvictionMethod.select))


@dataclass
class ScorerWrapper(HeadAdaptiveEvictionMethod):
    """A method over another scoring method: `base` (a registered plain scorer, built with `base_options` and
    this method's budget) observes every step and scores the tokens; the wrapper (re-weights them and)
    selects. The base shares this method's per-sequence state (so it is realigned on eviction
    and dropped with the sequence). `head_adaptive` chooses the selection: per kv-head top-budget (False) or
    the layer's kv_heads x budget best jointly (True, HeadAdaptiveEvictionMethod)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "evict")
    decode: str = "none"
    base: str = "snapkv"
    base_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        bases = plain_scorers()
        if self.base not in bases:
            raise UserError(f"invalid {self.name}.base={self.base!r}: choose one of {', '.join(bases)}")
        if not isinstance(self.base_options, dict):
            raise UserError(f"invalid {self.name}.base_options={self.base_options!r}: expected a mapping of "
                            f"{self.base}'s options")
        ratio = getattr(self, "compression_ratio", None)  # the base gets the same knob as the wrapper
        knob = {} if ratio is None else {"compression_ratio": ratio}
        self.inner = build_method(self.base, self.budget, **knob, **dict(self.base_options))
        self.inner._state = self._state  # one per-sequence state for both
        self.needs_key_scores = self.inner.needs_key_scores  # type: ignore[misc]

    @property
    def head_adaptive(self) -> bool:
        return True

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "layer" if self.head_adaptive else "table"

    @property
    def store_pre_rope(self) -> bool:
        return self.inner.store_pre_rope

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
        bind = getattr(self.inner, "bind_engine", None)
        if bind is not None:
            bind(engine)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["base_settings"] = {k: v for k, v in self.inner.describe().items() if k != "budget"}
        return d

    # --- the base observes and scores; the wrapper selects ---------------------------------------
    def observe(self, ctx: LayerContext, i: int, slot: int) -> None:
        self.inner.budget = self.budget  # a budget set per run (compression_ratio) reaches the base too
        self.inner.observe(ctx, i, slot)

    def recent_window(self) -> int:
        self.inner.budget = self.budget
        return self.inner.recent_window()

    def recent_kept(self, ctx: LayerContext) -> int:
        """At prefill the base's recent window alone, no newest-token floor: kvpress's AdaKVPress and CriticalKVPress
        compress the prompt by score alone, so a prompt's last token stays only if it scores high enough (or lies in
        the base's window, as SnapKV's). While decoding (decode="evict") the newest token stays."""
        if ctx.phase == "prefill":
            return min(self.recent_window(), self.budget)
        return super().recent_kept(ctx)

    def score(self, ctx: LayerContext, i: int, slot: int) -> torch.Tensor:
        return self.inner.score(ctx, i, slot)

    def select(self, ctx: LayerContext, i: int, slot: int, lengths: torch.Tensor) -> torch.Tensor:
        if self.head_adaptive:
            return super().select(ctx, i, slot, lengths)
        return ScoreEvictionMethod.select(self, ctx, i, slot, lengths)

    def evict_to_budget(self, ctx: LayerContext, i: int, slot: int) -> None:
        if self.head_adaptive:
            return super().evict_to_budget(ctx, i, slot)
        return ScoreEvictionMethod.evict_to_budget(self, ctx, i, slot)


@dataclass
class BlockScoreEvictionMethod(EvictionMethod):
    """PagedEviction-style eviction by a per-token score: implement `token_scores(k, v)`.

    Prefill: token-level eviction of the lowest-scoring tokens down to the budget; with
    `prefill_keep_first_block` the first block_size prompt tokens (the attention sinks) are kept, with
    `protect_last_block` the table's last, possibly partial, block (the prompt's end: a chat template's
    "<|im_start|>assistant\n") too.
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
    decode_reads_attention: ClassVar[bool] = False  # token_scores read the cached K/V only
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

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        self._check_budget(cache.block_size)

    def after_attention(self, ctx: LayerContext) -> None:
        if ctx.phase == "decode" and self.compression_ratio is None and not self._may_evict_in_decode(ctx):
            return  # most decode steps: no table of this layer reached a block boundary above the budget
        super().after_attention(ctx)

    def _may_evict_in_decode(self, ctx: LayerContext) -> bool:
        """Whether EvictionMethod.after_attention could act on this layer in this decode step: for some sequence, a
        first step, or a table above the configured budget (a sequence's budget is never less) whose newest block
        has just filled, whose heads differ in length, or that runs a block over (evict_decode's cases)."""
        bs, lo, seen = ctx.cache.block_size, self._configured_budget, ctx.cache.tokens_seen
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

    def token_scores(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """k, v [H, T, D] as cached, valid [H, T] -> importance [H, T] (higher = keep)."""
        raise NotImplementedError

    def _scores(self, ctx: LayerContext, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, _ = ctx.cache.gather(ctx.layer, slot)  # [H, T, D]
        lengths = ctx.cache.lengths[slot, ctx.layer]
        valid = valid_mask(lengths, k.shape[1])
        s = self.token_scores(k.float(), v.float(), valid).masked_fill(~valid, 0.0)  # [H, T]
        if self.heads == "shared":
            cfg = getattr(self, "model_config", None)
            if tp_size_of(cfg) > 1:  # the mean over every kv-head of the layer, on every rank
                every, _ = gather_head_scores(s, lengths, cfg, int(ctx.cache.tokens_seen[slot]))
                s = every.mean(dim=0, keepdim=True)[:, : s.shape[1]].expand_as(s)
            else:
                s = s.mean(dim=0, keepdim=True).expand_as(s)
        return s, lengths

    def evict_prefill(self, ctx: LayerContext, i: int, slot: int) -> None:
        lengths = ctx.cache.lengths[slot, ctx.layer]
        if int(lengths.max()) <= self.budget:
            return
        s, lengths = self._scores(ctx, slot)
        bs = ctx.cache.block_size
        sinks = bs if self.prefill_keep_first_block else 0
        # the table's last, possibly partial, block: after a prompt, its last P % bs (or bs) tokens
        tail = (int(lengths.max()) % bs or bs) if self.protect_last_block else 0
        if self.heads == "shared":
            keep = top_tokens(s[:1], self.budget, lengths[:1], recent=tail, sinks=sinks).expand(s.shape[0], -1)
        else:
            keep = top_tokens(s, self.budget, lengths, recent=tail, sinks=sinks)
        self.keep(ctx, slot, keep)

    def evict_decode(self, ctx: LayerContext, i: int, slot: int) -> None:
        cache, layer, bs = ctx.cache, ctx.layer, ctx.cache.block_size
        lengths = ctx.plan.table_lengths(i, layer)
        n = max(lengths)
        if n <= self.budget:
            return
        if n % bs or min(lengths) != n:
            if n >= self.budget + bs:  # not reached by plain decoding: fall back to tokens
                self.evict_prefill(ctx, i, slot)
            return
        s, _ = self._scores(ctx, slot)
        H, nb = s.shape[0], n // bs
        block = s.reshape(H, nb, bs).sum(-1)  # [H, nb]
        first = 1 if self.protect_first_block else 0
        end = nb - 1  # never the newest block
        if self.decode_topk is not None:  # the authors' code: only the oldest topk blocks after the first
            end = min(first + self.decode_topk, end)
        cand = block[:, first: end]
        n_drop = min(-(-(n - self.budget) // bs), cand.shape[1])
        if n_drop <= 0:
            return
        drop = cand.topk(n_drop, dim=-1, largest=False).indices + first  # [H, n_drop]
        if self.heads == "shared":
            drop = drop[:1].expand(H, -1)
        cache.evict_blocks_on_device(layer, slot, n, drop)  # the ids reach the pool with the step's tokens
