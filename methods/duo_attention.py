"""`duo_attention`: DuoAttention (Xiao et al., ICLR 2025, arXiv:2410.10819): retrieval heads and streaming heads.

Every (layer, kv-head) has a score (how much it needs the whole context). The `head_compression_ratio` share of
kv-heads with the lowest scores become streaming heads: they keep the first `sinks` tokens and the most recent
budget - sinks (budget = sinks + recent window, as streaming_llm); the other (retrieval) heads keep every token.
The streaming heads' tables really shrink and their blocks go back to the pool (kvpress masks them with fake keys,
freeing nothing).

Head scores, one of:
  patterns_path   DuoAttention's published pattern of the model: `full_attention_heads.tsv` (layers x kv-heads,
                  tab-separated, clipped to [0, 1] as duo_attn.utils.load_attn_pattern does), or the folder that
                  holds it (with its `config.json`, whose sink_size is the default `sinks`). The patterns cannot be
                  downloaded here (kvpress fetches them from GitHub): give the path of a copy.
  on_the_fly=true kvpress's `duo_attention_on_the_fly` estimate: over `on_the_fly_samples` texts (kvpress: 50
                  BookSum chapters; here the packaged essays, at most `on_the_fly_max_tokens` tokens each), the mean
                  pre-RoPE query and key of each layer are repeated over 500 positions and rotated; the score of a
                  kv-head is the area under the cumulated attention of the last query (mean over its query heads),
                  averaged over the samples. kvpress's sinks for it: 128. Needs the model's tokenizer.
Defaults: head_compression_ratio 0.5 (the paper's setting for GQA models: half the heads retrieval; kvpress's
default 0.0 streams nothing and is set per run on its leaderboard). The official code streams during chunked
prefill (prefill_mode=streaming, default) and keeps the streaming heads' cache constant while decoding
(decode=window: when a streaming head reaches budget + block_size tokens it drops back to budget); kvpress
compresses once after the prompt (prefill_mode=paper decode=none).
"""
from __future__ import annotations

import json
import math
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from kvbench.data.essays import load_essays
from kvbench.errors import UserError
from kvbench.methods.base import Method, register_method
from kvbench.methods.checks import check_bool, check_float, check_int
from kvbench.methods.eviction import EvictionMethod
from kvbench.runtime.contract import Engine, LayerContext, MethodCacheView, Observation, apply_rotary

PATTERN_FILE = "full_attention_heads.tsv"
ON_THE_FLY_SINKS = 128  # kvpress: sink_size, recent_size = 128, 256 for duo_attention_on_the_fly
ON_THE_FLY_QUERY_LEN = 500  # kvpress's q_len


def load_pattern(path: str) -> tuple[torch.Tensor, Optional[int]]:
    """DuoAttention's head pattern: (scores [L, H] clipped to [0, 1], sink_size from config.json or None)."""
    tsv = os.path.join(path, PATTERN_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(tsv):
        raise UserError(f"invalid duo_attention.patterns_path={path!r}: no {PATTERN_FILE} there (DuoAttention's "
                        "published patterns cannot be downloaded here: give the path of a copy, or on_the_fly=true)")
    try:
        rows = [[float(x) for x in line.split("\t")] for line in open(tsv, encoding="utf-8").read().splitlines()
                if line.strip()]
        scores = torch.tensor(rows, dtype=torch.float32)
    except (ValueError, RuntimeError):
        raise UserError(f"invalid duo_attention.patterns_path={path!r}: {tsv} is not a tab-separated table of "
                        "numbers (one row per layer, one column per kv-head)") from None
    cfg = os.path.join(os.path.dirname(tsv), "config.json")
    sinks = json.load(open(cfg, encoding="utf-8")).get("sink_size") if os.path.isfile(cfg) else None
    return scores.clamp(0, 1), sinks


def streaming_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """[L, H] bool: the round(ratio x L x H) lowest-scoring kv-heads stream (kvpress DuoAttentionPress)."""
    n = round(scores.numel() * ratio)
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    mask[scores.flatten().argsort(stable=True)[:n]] = True
    return mask.view(scores.shape)


class _MeanQK:
    """Hook for the calibration engine: the mean pre-RoPE query [Hq, D] and key [H, D] of each layer of one pass."""

    needs_key_scores = False
    acts_after_attention = True
    store_pre_rope = False
    rope_mode = "original"

    def __init__(self, rotary: Any):
        self.rotary = rotary
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        pass

    def on_sequence_end(self, slot: int) -> None:
        pass

    def on_fork(self, parent: int, child: int) -> None:
        pass

    def _unrotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rotary.lookup(pos)  # [..., D] (attention_scaling included: cos^2 + sin^2 = scaling^2)
        return apply_rotary(x.float(), cos.float(), -sin.float()) / (self.rotary.scaling ** 2)

    def after_attention(self, ctx: LayerContext) -> None:
        slot = ctx.plan.slot_list[0]
        q = self._unrotate(ctx.q[0].transpose(0, 1), ctx.plan.query_positions[0][:, None])  # [Q, Hq, D]
        k, _, pos = ctx.cache.gather(ctx.layer, slot)  # [H, T, D], [H, T]
        k = self._unrotate(k, pos)
        self.q[ctx.layer] = q.mean(0)  # [Hq, D]
        self.k[ctx.layer] = k.mean(1)  # [H, D]


_ON_THE_FLY_CACHE: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def on_the_fly_scores(engine: Any, samples: list[list[int]]) -> torch.Tensor:
    """kvpress's duo_attention_on_the_fly over token sequences, through a calibration engine on the same model
    (its own small pool: the run's pool and peak are untouched) -> head scores [L, H]."""
    model = engine.model
    cfg = model.config
    L, H, G, D = cfg.num_layers, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    longest = max(len(s) for s in samples)
    bs = 16
    hook = _MeanQK(model.rotary)
    calib = Engine(model, hook, block_size=bs, num_blocks=L * H * -(-longest // bs) + 2, prefill_chunk_size=longest)
    positions = torch.arange(ON_THE_FLY_QUERY_LEN, device=model.device)
    cos, sin = model.rotary.lookup(positions)  # [q_len, D]
    cos, sin = cos.float(), sin.float()
    scores = torch.zeros(L, H)
    for ids in samples:
        slot = calib.new_sequence()
        try:
            calib.forward_chunk(slot, ids, 0, logits_for="none")
        finally:
            calib.end_sequence(slot)
        for layer in range(L):
            q_last = apply_rotary(hook.q[layer], cos[-1], sin[-1])  # [Hq, D]: the last of q_len mean queries
            k = apply_rotary(hook.k[layer][:, None, :], cos, sin)  # [H, q_len, D]
            k = k.repeat_interleave(G, dim=0)  # [Hq, q_len, D]
            attn = torch.softmax(torch.einsum("hd,htd->ht", q_last, k) / math.sqrt(D), dim=-1)  # [Hq, q_len]
            s = attn.cumsum(-1).mean(-1)  # area under the cumulated attention curve
            scores[layer] += s.view(H, G).mean(-1).cpu() / len(samples)
    return scores


@register_method("duo_attention")
@dataclass
class DuoAttention(EvictionMethod, Method):
    """Retrieval heads keep everything; streaming heads keep sinks + recent window (budget = sinks + window)."""

    granularity: ClassVar[str] = "block"
    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("window", "none")
    decode: str = "window"
    prefill_mode: str = "streaming"
    patterns_path: Optional[str] = None
    on_the_fly: bool = False
    head_compression_ratio: float = 0.5
    sinks: Optional[int] = None
    on_the_fly_samples: int = 50
    on_the_fly_max_tokens: int = 4096
    head_scores: Any = field(default=None, init=False, repr=False, compare=False)

    def tensor_parallel_refusal(self) -> str | None:
        return "its retrieval/streaming head pattern is chosen over every kv-head of the model, not per shard"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "on_the_fly", self.on_the_fly)
        check_float(self.name, "head_compression_ratio", self.head_compression_ratio, 0.0, 1.0)
        check_int(self.name, "on_the_fly_samples", self.on_the_fly_samples, 1)
        check_int(self.name, "on_the_fly_max_tokens", self.on_the_fly_max_tokens, 2)
        if (self.patterns_path is None) == (not self.on_the_fly):
            raise UserError("duo_attention needs its head pattern from one source: method.patterns_path=PATH "
                            f"(DuoAttention's {PATTERN_FILE}, which cannot be downloaded here) or "
                            "method.on_the_fly=true (kvpress's estimate), not both")
        pattern_sinks = None
        if self.patterns_path is not None:
            self.head_scores, pattern_sinks = load_pattern(str(self.patterns_path))
        if self.sinks is None:
            self.sinks = int(pattern_sinks) if pattern_sinks is not None else ON_THE_FLY_SINKS
        check_int(self.name, "sinks", self.sinks, 0)
        if self.budget is not None and self.budget <= self.sinks:
            raise UserError(f"invalid budget {self.budget} for duo_attention with sinks={self.sinks}: the budget "
                            "must exceed sinks (streaming heads keep budget = sinks + recent window)")
        self.mask: Optional[torch.Tensor] = None  # [L, H] True = streaming head (shape checked at attach)
        if self.head_scores is not None:
            self.mask = streaming_mask(self.head_scores, self.head_compression_ratio)

    def window(self, budget: int) -> int:
        """The streaming heads' recent window under `budget`."""
        return budget - self.sinks

    def min_budget(self) -> int:
        """The smallest budget a sequence may get (a budget derived from a compression ratio): sinks + 1."""
        return self.sinks + 1

    def attach(self, cache: MethodCacheView, model_config: Any) -> None:
        super().attach(cache, model_config)
        if self.head_scores is not None:
            self._set_scores(self.head_scores, model_config)

    def bind_engine(self, engine: Any) -> None:
        """On the fly: estimate the head scores with the engine's model (cached per model and settings)."""
        if not self.on_the_fly:
            return
        key = (self.on_the_fly_samples, self.on_the_fly_max_tokens)
        per_model = _ON_THE_FLY_CACHE.setdefault(engine.model, {})
        if key not in per_model:
            per_model[key] = on_the_fly_scores(engine, self._calibration_samples(engine.model))
        self._set_scores(per_model[key], engine.model.config)

    def _calibration_samples(self, model: Any) -> list[list[int]]:
        tok = getattr(model, "tokenizer", None)
        if tok is None:
            raise UserError("duo_attention on_the_fly needs the model's tokenizer (to read the calibration "
                            "essays); give method.patterns_path instead")
        limit = min(self.on_the_fly_max_tokens, model.config.max_position_embeddings)
        texts = [text for _, text in load_essays()][: self.on_the_fly_samples]
        return [list(tok.encode(text))[:limit] for text in texts]

    def _set_scores(self, scores: torch.Tensor, model_config: Any) -> None:
        want = (model_config.num_layers, model_config.num_kv_heads)
        if tuple(scores.shape) != want:
            raise UserError(f"invalid duo_attention.patterns_path={self.patterns_path!r}: its pattern is "
                            f"{tuple(scores.shape)} (layers x kv-heads), the model has {want}")
        self.head_scores = scores
        self.mask = streaming_mask(scores, self.head_compression_ratio)

    def table_budget(self, layer: int, head: int) -> int | None:
        """Streaming heads hold at most the budget; retrieval heads keep every token (no bound)."""
        return self.budget if self.mask is not None and bool(self.mask[layer, head]) else None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.pop("head_scores", None)
        d["window"] = self.window(self.budget) if self.budget is not None else None
        if self.mask is not None:
            d["streaming_heads"] = int(self.mask.sum())
        return d

    # ------------------------------------------------------------------ eviction
    def _evict_streaming(self, obs: Observation, budget: int, trigger: int) -> None:
        if self.mask is None:
            raise RuntimeError("duo_attention: no head pattern (the engine did not call bind_engine)")
        lengths = obs.table_lengths()  # [H] host ints
        streaming = self.mask[obs.layer].tolist()
        if not any(s and n >= trigger for s, n in zip(streaming, lengths)):
            return
        dev = obs.cache.lengths.device
        window = self.window(budget)
        rows = []
        for s, n in zip(streaming, lengths):
            if s and n > budget:
                rows.append(torch.cat([torch.arange(self.sinks, device=dev), torch.arange(n - window, n, device=dev)]))
            else:
                rows.append(torch.arange(n, device=dev))
        width = max(r.numel() for r in rows)
        keep = torch.full((len(rows), width), -1, dtype=torch.int64, device=dev)
        for h, r in enumerate(rows):
            keep[h, : r.numel()] = r
        self.keep(obs, keep)

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        self._evict_streaming(obs, budget, budget + 1)

    def evict_decode(self, obs: Observation, budget: int) -> None:
        # the window slides a block at a time: a streaming head at budget + block_size drops back to budget
        self._evict_streaming(obs, budget, budget + obs.block_size)
