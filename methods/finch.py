"""`finch`: FINCH (Corallo & Papotti, TACL 2024; kvpress `FinchPress`): SnapKV-style prompt compression whose
observation window is the question, with the kept keys re-rotated.

Query-aware: the prompt is context + question, compressed together (task.compress_question=true). The window is the
question's tokens (kvpress finds them after a delimiter token; here the task tells the method through the optional
`question_tokens(slot, n)` hook, Request.question_tokens), or the last `window` prompt tokens when set. Score, per
kv-head, of every token before the window: the window queries' softmax attention (1/sqrt(D), causal, over every
key), each query's row multiplied by its position (kvpress's normalize_scores: T-W .. T-1, the number of non-zero
weights it could have), averaged over the window and the query heads of a kv-head; the window scores the largest
score + 1 (always kept). Each kv-head keeps its int(T x (1 - ratio)) best tokens (the budget), or with
`chunk_length` max(1, int(len x (1 - ratio))) per chunk of that many tokens. With `rerotate_keys` (default) the kept
keys are re-rotated to positions 0..n-1 in their order (kvpress's KeyRerotationPress.rerotate_keys): the cache's keys
and positions are rewritten (cache.rewrite_tokens), and the tokens after the compressed prompt (an uncompressed
question tail, then the generated ones) continue at positions n, n + 1, ... (cache.continue_positions_at), as
kvpress's pipeline continues generation at the compressed length (`context_length = cache.get_seq_length()` after
FinchPress or KeyRerotationPress). n is layer 0's kept length (every layer keeps as many); on a model whose layer 0
is a sliding-window layer (never compressed: kvpress's get_seq_length() counts every token there) the later tokens
keep their own positions, and a model with sliding layers after a full layer 0 is refused with re-rotation (their
keys cannot follow the shifted positions). Without re-rotation the kept keys and the later tokens keep their original positions (kvpress: the
context's length). Prefill only (decode="none").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_int
from kvbench.methods.expected_attention import unrotate
from kvbench.methods.observers import push_queries
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.selection import sort_keep, valid_mask
from kvbench.runtime.contract import Observation, rotate_half


def finch_scores(q: torch.Tensor, k: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """FINCH's score [H, T] of a prompt: q [Hq, W, D] the window's post-RoPE queries (the prompt's last W tokens),
    k [H, T, D] post-RoPE keys; the window's own columns score the largest score + 1."""
    Hq, W, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    logits = torch.matmul(q.float(), k.float().repeat_interleave(G, dim=0).transpose(1, 2)) / D ** 0.5  # [Hq, W, T]
    causal = torch.arange(T, device=k.device)[None, :] > torch.arange(T - W, T, device=k.device)[:, None]  # [W, T]
    probs = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)[..., : T - W]
    if normalize:
        probs = probs * torch.arange(T - W, T, device=k.device, dtype=probs.dtype)[None, :, None]
    s = probs.mean(dim=1).view(H, G, T - W).mean(dim=1)  # [H, T-W]
    top = float(s.max()) + 1 if s.numel() else 1.0
    return torch.cat([s, s.new_full((H, W), top)], dim=1)


def chunked_keep(scores: torch.Tensor, chunk_length: int, ratio: float) -> torch.Tensor:
    """kvpress FinchPress's chunked selection: max(1, int(len x (1 - ratio))) best of each chunk -> [H, n] sorted."""
    T = scores.shape[-1]
    idx = []
    for i in range(0, T, chunk_length):
        c = scores[:, i: i + chunk_length]
        idx.append(i + c.topk(max(1, int(c.shape[1] * (1 - ratio))), dim=-1).indices)
    return torch.cat(idx, dim=-1).sort(dim=-1).values


@register_method("finch")
@dataclass
class Finch(ScorerMethod):
    """The question's attention, position-normalised; kept keys re-rotated to 0..n-1."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    keeps_newest_at_prefill: ClassVar[bool] = False
    reads_question: ClassVar[bool] = True  # kvbench.run.spec.check_question_source: the task must say the question
    decode: str = "none"
    window: Optional[int] = None
    chunk_length: Optional[int] = None
    normalize_scores: bool = True
    rerotate_keys: bool = True
    _questions: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window is not None:
            check_int(self.name, "window", self.window, 1)
        if self.chunk_length is not None:
            check_int(self.name, "chunk_length", self.chunk_length, 1)
        check_bool(self.name, "normalize_scores", self.normalize_scores)
        check_bool(self.name, "rerotate_keys", self.rerotate_keys)

    @staticmethod
    def rewrites_cache(options: dict) -> bool:
        """kvbench.run.spec.check_rewrite_storage: re-rotation rewrites the kept keys in place."""
        return options.get("rerotate_keys", True) is not False

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.pop("_questions", None)
        return d

    # --- the question's extent ------------------------------------------------------------------
    def question_tokens(self, slot: int, num_tokens: int) -> None:
        """The prompt of `slot` ends with a question of num_tokens tokens (the runtime's optional hook)."""
        self._questions[slot] = int(num_tokens)

    def on_sequence_end(self, slot: int) -> None:
        super().on_sequence_end(slot)
        self._questions.pop(slot, None)

    def window_of(self, slot: int) -> int:
        if self.window is not None:
            return self.window
        if slot not in self._questions:
            raise UserError("finch needs the question's extent: run a query-aware task (task.compress_question=true) "
                            "or set method.window=N (the last N prompt tokens)")
        return self._questions[slot]

    def observe(self, obs: Observation) -> None:
        if obs.phase == "prefill":
            push_queries(self.state(obs.slot, obs.layer), obs, self.window_of(obs.slot))
            st = self.state(obs.slot, obs.layer)
            obs.queries, obs.query_positions = st["q"], st["q_pos"]

    # --- score, select, re-rotate ---------------------------------------------------------------
    def score(self, obs: Observation) -> torch.Tensor:
        if obs.pre_rope:
            raise UserError(f"method {self.name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        W = min(self.window_of(obs.slot), obs.queries.shape[1])
        lengths = obs.table_lengths()
        T = max(lengths)
        if min(lengths) != T or W >= T:
            raise RuntimeError(f"{self.name}: compresses a whole prompt longer than its window once "
                               f"(tables {lengths}, window {W})")
        return finch_scores(obs.queries[:, -W:], obs.keys, self.normalize_scores)

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.lengths
        T = int(lengths.max())
        if T <= budget:
            return
        s = self.score(obs)
        if self.chunk_length is None:
            keep = sort_keep(s.topk(budget, dim=-1).indices, T)
        else:
            ratio = self.compression_ratio if self.compression_ratio is not None else 1 - budget / T
            keep = chunked_keep(s, self.chunk_length, ratio)
        self.keep(obs, keep)
        if self.rerotate_keys:
            self.rerotate(obs)
            if obs.layer == 0:
                self.continue_after_prompt(obs)

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: the refusal of continue_after_prompt, from the model's layer windows."""
        windows = getattr(model_shape, "layer_windows", ()) or ()
        if self.rerotate_keys and windows and windows[0] is None and any(w is not None for w in windows):
            raise UserError(self._sliding_refusal())

    def _sliding_refusal(self) -> str:
        return (f"method {self.name!r} with rerotate_keys=true continues the positions after the prompt at its "
                f"compressed length, which this model's sliding-window layers (their keys at their own positions) "
                f"cannot follow: use method.rerotate_keys=false")

    def continue_after_prompt(self, obs: Observation) -> None:
        """kvpress's pipeline: the tokens after the prompt start at cache.get_seq_length(), layer 0's length (the kept
        n here; a sliding layer 0, never compressed, counts every token: they keep their own positions). A model with
        sliding layers after a full layer 0 is refused: its sliding layers' keys keep their positions, past n."""
        cache = obs.cache
        if len(cache.method_layers) < cache.num_layers:
            raise UserError(self._sliding_refusal())
        cache.continue_positions_at(obs.slot, int(obs.lengths.max()))

    def rerotate(self, obs: Observation) -> None:
        """Move every kept key to its index in the table: keys rotated from their positions to 0..n-1."""
        k, pos = obs.keys, obs.positions  # [H, n, D], [H, n]
        H, n, _ = k.shape
        new_pos = torch.arange(n, device=pos.device).expand(H, n)
        new_pos = torch.where(valid_mask(obs.lengths, n), new_pos, torch.full_like(new_pos, -1))
        cos0, sin0 = obs.rotary.lookup(pos)  # [H, n, D]
        cos1, sin1 = obs.rotary.lookup(new_pos)
        pre = unrotate(k.float(), cos0.float(), sin0.float())
        moved = pre * cos1.float() + rotate_half(pre) * sin1.float()
        obs.cache.rewrite_tokens(obs.layer, obs.slot, keys=moved.to(k.dtype), positions=new_pos)
        obs.refresh()
