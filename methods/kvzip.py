"""`kvzip`: KVzip (Kim et al., 2025, arXiv:2505.23416), query-agnostic scores from context reconstruction.

After the prompt is prefilled, the model is asked to repeat it: the cache is fed "\\n\\nRepeat the previous context
exactly." + the chat template's assistant-turn start + the context itself (teacher-forced), and each cached
context token's score is the largest attention it receives from those reconstruction queries (max over the
queries and over the query heads of its kv-head). As kvpress's KVzipPress (defaults: chunk_size 2048,
prev_postfix_size 8, n_sink 4, layerwise false):
  * a context longer than `chunk_size` tokens is reconstructed chunk by chunk; later chunks are asked with
    "\\n\\nRepeat the part of the previous context exactly, starting with" + the previous chunk's last
    `prev_postfix_size` tokens; each chunk's queries attend over the first min(n_sink, chunk start) tokens, the
    chunk's own keys and the reconstruction tokens (causal), so the softmax sees only those;
  * the first `n_sink` tokens are always kept (they score above any attention probability, as kvpress's
    max + 1, with or without a template prefix); a chat-template prefix (the tokens before the user's content,
    found from the tokenizer's template as kvpress does) is not reconstructed and scores 0 beyond the sinks;
  * layerwise=false: the kept tokens are the layers x kv_heads x budget best over every layer and kv-head of the
    sequence jointly (budget_scope "sequence": layers and heads keep different counts); layerwise=true: each layer
    keeps its kv_heads x budget best jointly over its kv-heads ("layer").
The reconstruction tokens go through the engine's public API (Engine.forward_chunk, positions after the context,
scratch=True: not counted as the sequence's tokens, so the prompt's length, full_kv_bytes and prefill_stats are the
context's alone) and the method scores them in its own after_attention hook; afterwards they are dropped and the
context is evicted to the budget, so the pool's peak includes one reconstruction chunk (as KVzip's own). Tables
really shrink per head (kvpress masks instead). Where the pass runs:
  * a model whose layers are all full: on the sequence itself; the pass's tokens are then dropped with the cache's
    keep_tokens (their blocks return to the pool);
  * a model with sliding-window layers (Gemma 2/3, GPT-OSS): on a copy-on-write fork of the sequence
    (Engine.fork_sequence(scratch=True)), ended afterwards, since the pass would slide a sliding layer's ring
    (PagedKVCache.slide_window) past the context's window. The sequence's tables, rings and positions are never
    touched by the pass; the scores of the fork's full layers go to the sequence's state. Only the full layers
    (cache.method_layers) are scored and evicted; the sliding layers stay whole, as KVzip's own code
    (attention/kvcache.py RetainHybridCache: backup_sliding_cache before the pass, restore_sliding_cache after).
    The pool's peak then also holds the partial last blocks the fork copies before appending (one per table at
    most) and the fork's sliding-layer tokens of the pass (its rings slide as any sequence's).
  The sequence budget is layers x kv_heads x budget over the full layers (cache.method_layers).
The template prefix follows kvpress, not KVzip's own code (snu-mllab/KVzip attention/kvcache.py, score.py): there
the whole prefix (the system prompt) is kept outside the budget and is every chunk's softmax sink; kvpress and
kvbench keep its first n_sink tokens, score the rest 0 (evicted first) and count it in the budget.
`kvzip_plus_normalization` (KVzip+, kvpress's option, default false; the board's `kvzip_plus` and KVzap's training
target): each reconstruction probability is divided by its query's ||h|| (the attention input) and multiplied by
||W_o,head v|| of its key before the max; the sinks then score +inf (always kept; KVzip+ scores are not bounded
by 1). Timing: after every prompt
(prefill_mode=paper: once the last prefill chunk is in; streaming: after every chunk, each chunk reconstructed
as it arrives); decoding appends (decode=none, the paper's and kvpress's). Needs the model's tokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.runtime.contract import Observation, full_kv_heads, gather_head_scores, local_keep, tp_size_of
from kvbench.methods.base import Method, register_method
from kvbench.methods.checks import check_bool, check_int
from kvbench.methods.eviction import EvictionMethod
from kvbench.methods.selection import (gather_aligned, top_tokens_in_layer,
                                      valid_mask)

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
SLOT_STATE = -1  # state key (slot, SLOT_STATE): the sequence's token ids and how far it is scored


def template_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids) of the chat template around a user message, as kvpress finds them: the tokens
    before the user's content, and the end of the user turn + the assistant turn's start ("\\n" with no template)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return [], list(tokenizer.encode("\n", add_special_tokens=False))
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
    context, suffix = text.split(separator)
    prefix = context.split(dummy)[0]
    return (list(tokenizer.encode(prefix, add_special_tokens=False)),
            list(tokenizer.encode(suffix, add_special_tokens=False)))


def plus_weights(hidden: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KVzip+'s normalisation factors (kvpress kvzip_plus_normalization): 1 / ||h|| of each query's attention
    input [Q] and ||W_o,head v|| of each key for each query head [H, G, T] (L2 over the model dimension).

    hidden [Q, E]; v [H, T, D] cached values; w_o [E, Hq * D] the output projection ([out, in])."""
    H, T, D = v.shape
    G = w_o.shape[1] // (H * D)
    w = w_o.float().view(-1, H, G, D).permute(1, 2, 3, 0)  # [H, G, D, E]
    wov = torch.stack([torch.matmul(v[h].float(), w[h]).norm(dim=-1) for h in range(H)])  # [H, G, T]
    return 1.0 / hidden.float().norm(dim=-1), wov


def reconstruction_scores(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                          lengths: torch.Tensor, scale: float, *, sinks: int, start: int, end: int,
                          context_len: int, plus: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """KVzip's score of the keys of context chunk [start, end) from reconstruction queries -> [H, T] (0 elsewhere).

    q [Hq, Q, D] reconstruction queries (post-RoPE) at positions q_pos [Q] (>= context_len); k [H, T, D] cached keys
    at positions k_pos [H, T]; lengths [H]. Each query's softmax runs over the keys at positions < sinks, in
    [start, end), and the reconstruction keys (positions >= context_len) up to its own; the probabilities of the
    chunk's keys are maxed over the queries and the query heads of each kv-head. plus = plus_weights(...): KVzip+,
    each probability divided by its query's ||h|| and multiplied by its key's ||W_o,head v|| before the max."""
    Hq, Q, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    logits = torch.matmul(q.reshape(H, G * Q, D).float(), k.float().transpose(-1, -2)) * scale  # [H, G*Q, T]
    kp = k_pos[:, None, :]  # [H, 1, T]
    chunk = (kp >= start) & (kp < end)
    seen = (kp < sinks) | chunk | ((kp >= context_len) & (kp <= q_pos.repeat(G)[None, :, None]))
    seen &= valid_mask(lengths, T)[:, None, :]
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
    if plus is not None:
        inv_h, wov = plus  # [Q], [H, G, T]
        probs = (probs.view(H, G, Q, T) * inv_h[None, None, :, None] * wov[:, :, None, :]).view(H, G * Q, T)
    return probs.masked_fill(~chunk, 0.0).amax(dim=1)  # [H, T]


@register_method("kvzip")
@dataclass
class KVzip(EvictionMethod, Method):
    """Context-reconstruction attention scores; the budget over all layers and heads (or per layer).

    On a model sharded by kv-head (runtime.tensor_parallel) the budget still spans every kv-head of the model, so
    each eviction gathers every rank's scores of every layer in one all-gather, ranks them all, and each rank keeps
    its own heads' share."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    decode: str = "none"
    layerwise: bool = False
    n_sink: int = 4
    chunk_size: int = 2048
    prev_postfix_size: int = 8
    kvzip_plus_normalization: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "layerwise", self.layerwise)
        check_bool(self.name, "kvzip_plus_normalization", self.kvzip_plus_normalization)
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_int(self.name, "chunk_size", self.chunk_size, 1)
        check_int(self.name, "prev_postfix_size", self.prev_postfix_size, 0)
        self.engine: Any = None
        self.reconstructing = False  # True while the method's own reconstruction tokens run through the engine
        self._pass: Optional[dict] = None
        self._held: dict[int, int] = {}  # slot -> tokens of its next chunk kept uncompressed

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "layer" if self.layerwise else "sequence"

    @property
    def reads_hidden_states(self) -> bool:
        """KVzip+ divides by each reconstruction query's ||h|| (its attention input)."""
        return bool(self.kvzip_plus_normalization)

    def bind_engine(self, engine: Any) -> None:
        tok = getattr(engine.model, "tokenizer", None)
        if tok is None:
            raise UserError("kvzip needs the model's tokenizer (to write its reconstruction prompt)")
        self.engine = engine
        self.prefix_ids, self.suffix_ids = template_parts(tok)
        self.first_ids = list(tok.encode(FIRST_PROMPT, add_special_tokens=False))
        self.next_ids = list(tok.encode(NEXT_PROMPT, add_special_tokens=False))

    # --- the hook protocol -------------------------------------------------------------------
    def observe(self, obs: Observation) -> None:
        p, slot = self._pass, obs.slot
        if not self.reconstructing or p is None or p["slot"] != slot:
            return
        k, k_pos, lengths = obs.keys, obs.positions, obs.lengths  # [H, T, D], [H, T], [H]
        plus = None
        if self.kvzip_plus_normalization:
            plus = plus_weights(obs.hidden_states, obs.values, self.engine.model.layers[obs.layer].o.dense_weight())
        s = reconstruction_scores(obs.step_queries, obs.step_query_positions, k, k_pos, lengths, obs.head_dim ** -0.5,
                                  sinks=min(self.n_sink, p["start"]), start=p["start"], end=p["end"],
                                  context_len=p["context_len"], plus=plus)
        st = self.state(p["owner"], obs.layer)  # the sequence's state (the pass may run on its fork)
        n_ctx = int(((k_pos >= 0) & (k_pos < p["context_len"])).sum(-1).max())  # context slots come first
        old = st.get("scores")
        if old is None:
            old = torch.zeros(s.shape[0], 0, device=s.device)
        if old.shape[-1] < n_ctx:
            old = torch.nn.functional.pad(old, (0, n_ctx - old.shape[-1]))
        st["scores"] = torch.maximum(old[:, :n_ctx], s[:, :n_ctx])

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        pass  # after the step: after_prefill_chunk runs the reconstruction, then evicts

    def evict_decode(self, obs: Observation, budget: int) -> None:
        pass  # decode=none: generated tokens are appended

    def after_prefill_chunk(self, slot: int, token_ids: list[int], start_pos: int, last_chunk: bool) -> None:
        """The engine's optional hook after a prefill chunk: record its tokens; at the prompt's end (or after
        every chunk when streaming) reconstruct what is not yet scored, then evict to the budget."""
        if self.reconstructing:
            return
        if self.engine is None:
            raise RuntimeError("kvzip: the engine did not call bind_engine")
        key = (slot, SLOT_STATE)
        st = self._state.get(key)
        held = self._held.pop(slot, 0)
        if start_pos == 0 or st is None:
            start = len(self.prefix_ids) if token_ids[: len(self.prefix_ids)] == self.prefix_ids else 0
            # a chat-template prefix is not reconstructed (kvpress: prefix_length)
            st = self._state[key] = {"ids": torch.empty(0, dtype=torch.int64), "start": start, "scored": start,
                                     "held": []}
        if start_pos != st["ids"].numel():  # tokens appended by decode steps in between: not reconstructed
            st["ids"] = torch.cat([st["ids"], torch.full((start_pos - st["ids"].numel(),), -1, dtype=torch.int64)])
            st["scored"] = start_pos
        st["ids"] = torch.cat([st["ids"], torch.tensor(token_ids, dtype=torch.int64)])
        if held == len(token_ids):  # kept uncompressed (a question after its context): never reconstructed/evicted
            st["held"].append((start_pos, start_pos + held))
            st["scored"] = st["ids"].numel()
            return
        ratio = getattr(self, "compression_ratio", None)
        if not (last_chunk or self.prefill_mode == "streaming"):
            return
        ids = st["ids"].tolist()
        context_len = len(ids)
        self._reconstruct_prompt(slot, ids, st["scored"], st["start"])
        st["scored"] = context_len
        if ratio is not None and not last_chunk:
            return  # a compression ratio is a share of the whole prompt: evict once it is in
        kept_whole = sum(b - a for a, b in st["held"])
        budget = self.budget if ratio is None else max(1, int((context_len - kept_whole) * (1.0 - ratio)))
        self._evict(slot, budget + kept_whole, st["held"])
        if last_chunk:  # prefill_stats: what the prompt kept once evicted (the base would record before this)
            for layer in self.engine.cache.method_layers:
                self.record_kept(self.engine.cache, slot, layer)

    def _record_kept(self, obs: Observation) -> None:
        pass  # the layer's step ends before the reconstruction and eviction: recorded in after_prefill_chunk

    def on_sequence_end(self, slot: int) -> None:
        self._held.pop(slot, None)
        super().on_sequence_end(slot)

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        """The next chunk of `slot` (num_tokens) stays uncompressed: kvzip neither reconstructs nor evicts it, and
        it adds to the sequence's budget (the query-agnostic protocol's question)."""
        self._held[slot] = int(num_tokens)
        super().keep_uncompressed(slot, num_tokens)

    # --- reconstruction and eviction -----------------------------------------------------------
    def _reconstruct_prompt(self, slot: int, ids: list[int], scored: int, start: int) -> None:
        """Score the tokens ids[scored:] (the sequence's tokens so far: ids): KVzip's reconstruction prompts, chunk by
        chunk (the first chunk, at the template prefix's end `start`, asked to repeat the context)."""
        context_len = len(ids)
        for a in range(scored, context_len, self.chunk_size):
            b = min(a + self.chunk_size, context_len)
            if a == start:
                ask = self.first_ids
            else:
                ask = self.next_ids + ids[max(0, a - self.prev_postfix_size): a]
            self._reconstruct(slot, ask + self.suffix_ids + ids[a:b], a, b, context_len)

    def _reconstruct(self, slot: int, feed: list[int], start: int, end: int, context_len: int) -> None:
        """Feed the reconstruction tokens after the context (scored in observe into `slot`'s state), then drop them:
        on a fork of `slot` ended afterwards where the model has sliding layers, else on `slot` itself."""
        cache, step = self.engine.cache, self.engine.prefill_chunk_size
        on_fork = len(cache.method_layers) != cache.num_layers  # a sliding layer's ring must not slide
        runs_on = self.engine.fork_sequence(slot, scratch=True) if on_fork else slot
        self.reconstructing = True
        self._pass = {"slot": runs_on, "owner": slot, "start": start, "end": end, "context_len": context_len}
        try:
            for a in range(0, len(feed), step):
                self.engine.forward_chunk(runs_on, feed[a: a + step], context_len + a, last_chunk=False,
                                          logits_for="none", scratch=True)  # not the sequence's tokens
        finally:
            self.reconstructing, self._pass = False, None
            if on_fork:
                self.engine.end_sequence(runs_on)  # the fork's own blocks return to the pool
            else:
                self._drop_pass_tokens(slot, context_len)

    def _drop_pass_tokens(self, slot: int, context_len: int) -> None:
        """Keep only the context's tokens (positions < context_len) of every layer: the pass's blocks are freed."""
        cache = self.engine.cache
        for layer in range(cache.num_layers):
            _, _, pos = cache.gather(layer, slot)  # [H, T]
            n_ctx = (pos >= 0) & (pos < context_len)
            keep = torch.where(n_ctx, torch.arange(pos.shape[1], device=pos.device), torch.full_like(pos, -1))
            cache.keep_tokens(layer, slot, keep.to(torch.int64))

    def _scores(self, slot: int, layer: int, held: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [H, T] of the layer's cached tokens and lengths [H]: the first n_sink tokens score 2.0, above any
        attention probability, whether or not a template prefix comes first (kvpress: score_val[..., :n_sink] =
        max + 1), tokens never reconstructed 0, tokens kept uncompressed +inf."""
        cache = self.engine.cache
        lengths = cache.lengths[slot, layer]
        _, _, pos = cache.gather(layer, slot)  # [H, T]
        T = pos.shape[1]
        s = self.state(slot, layer).get("scores")
        s = torch.zeros(pos.shape, device=pos.device) if s is None else \
            torch.nn.functional.pad(s, (0, max(0, T - s.shape[-1])))[:, :T]
        s = s.masked_fill((pos >= 0) & (pos < self.n_sink), float("inf") if self.kvzip_plus_normalization else 2.0)
        self.state(slot, layer)["scores"] = s
        for a, b in held:
            s = s.masked_fill((pos >= a) & (pos < b), float("inf"))
        return s, lengths

    def _evict(self, slot: int, budget: int, held: list[tuple[int, int]]) -> None:
        """Keep the layers x kv_heads x budget best tokens of the sequence (layerwise: kv_heads x budget per layer),
        over its full layers (cache.method_layers: a sliding layer is never evicted)."""
        cache, cfg = self.engine.cache, getattr(self, "model_config", None)
        layers = cache.method_layers
        L, H = len(layers), cache.num_kv_heads
        per_layer = [self._scores(slot, layer, held) for layer in layers]
        if tp_size_of(cfg) > 1:  # the budget spans every kv-head: every rank's scores, in one all-gather
            width = int(cache.tokens_seen[slot])
            s_all, n_all = gather_head_scores(
                torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[1])) for s, _ in per_layer]),
                torch.stack([n for _, n in per_layer]), cfg, width)  # [L, H_all, width], [L, H_all]
            per_layer, H = [(s_all[layer], n_all[layer]) for layer in range(L)], full_kv_heads(cfg)
        if self.layerwise:
            for layer, (s, lengths) in zip(layers, per_layer):
                if int(lengths.sum()) > H * budget:
                    self._keep(slot, layer, local_keep(top_tokens_in_layer(s, H * budget, lengths), cfg))
            return
        lengths = torch.stack([n for _, n in per_layer])  # [L, H]
        if int(lengths.sum()) <= L * H * budget:
            return
        T = max(s.shape[1] for s, _ in per_layer)
        s = torch.stack([torch.nn.functional.pad(x, (0, T - x.shape[1])) for x, _ in per_layer])  # [L, H, T]
        keep = top_tokens_in_layer(s.view(L * H, T), L * H * budget, lengths.view(-1)).view(L, H, -1)
        for i, layer in enumerate(layers):
            k = local_keep(keep[i], cfg)
            self._keep(slot, layer, k[:, : max(1, int((k >= 0).sum(-1).max()))])

    def _keep(self, slot: int, layer: int, keep: torch.Tensor) -> None:
        self.engine.cache.keep_tokens(layer, slot, keep)
        st = self.state(slot, layer)
        st["scores"] = gather_aligned(st["scores"], keep)
