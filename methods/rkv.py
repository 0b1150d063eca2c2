"""`rkv`: R-KV, redundancy-aware decode-time eviction for reasoning traces (Cai et al., arXiv:2505.24133; official
code github Zefan-Cai/R-KV, `rkv/compression/r1_kv.py` and `rkv/utils.py`).

A table over the budget is compressed to `budget` tokens every `buffer` decode steps (the official code's staging
buffer, `divide_length` 128: it compresses every 128 generated tokens), and once after the prompt if the prompt
exceeds the budget (decode="evict" runs kvbench's one periodic policy with interval `buffer`,
methods.eviction.EvictionMethod.evict_every). A compression keeps the newest `window` tokens (the observation
window) plus the `budget - window` best of the older ones by

    score = mix_lambda * importance - (1 - mix_lambda) * redundancy

  importance  the last `window` queries' attention over the older keys: per kv-head, the logits of its query heads
              pooled by max (`gqa_pooling`, the official `compute_attention_scores`), softmax over the older keys
              only, averaged over the window, then max-pooled along the tokens (kernel `kernel_size`, stride 1)
  redundancy  key cosine similarity: per kv-head the [T, T] cosine matrix of every cached key (diagonal 0); in
              each row the most recent key more similar than `similarity_threshold` is zeroed (it is "retained":
              the newest near-duplicate is not counted against); the column means, softmax over the tokens

Defaults are the official code's (run_math.py and R1KV): window 8, kernel 7, mix_lambda 0.07, buffer 128,
threshold 0.5. Where the paper's text differs the code wins (docs/methods.md): the README's lambda is 0.1 and its
redundancy keeps "at most beta most-recent similar neighbours", the code uses 0.07 and zeroes exactly one (the last).
Deliberate differences, both forced by a paged cache that keeps tokens in position order:
  * the official code triggers on the sequence length (`length % 128 == 0`), so its cache holds budget to
    budget + 127 tokens after the prompt was cut to budget; here every `buffer` decode steps of the sequence,
    the same bound whatever the prompt length;
  * the official code stores the kept tokens in top-k order (not position order), so its later max-pooling and
    "last similar" run over score-rank neighbours; here the cache stays in position order and both run over
    position neighbours (the first compression, which the parity test checks, is identical).
Memory: a table holds at most budget + buffer - 1 tokens after a step (`decode_overshoot`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice, check_float, check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.selection import sort_keep
from kvbench.runtime.contract import Observation

GQA_POOLINGS = ("max", "mean")


def rkv_importance(q: torch.Tensor, k: torch.Tensor, window: int, kernel: int, gqa_pooling: str = "max") -> torch.Tensor:
    """Importance [H, T - window] of the keys older than the window.

    q [Hq, W, D]: the last `window` queries (as used by attention); k [H, T, D] keys as cached (post-RoPE)."""
    Hq, W, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    logits = torch.matmul(q.float().reshape(H, G, W, D), k.float().transpose(-1, -2)[:, None]) / D ** 0.5  # [H,G,W,T]
    logits = logits.amax(dim=1) if gqa_pooling == "max" else logits.mean(dim=1)  # [H, W, T]
    probs = torch.softmax(logits[:, -window:, : T - window], dim=-1).mean(dim=-2)  # [H, T - window]
    return F.max_pool1d(probs[:, None, :], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0, :]


def rkv_redundancy(k: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Redundancy [H, T] of every cached key (k [H, T, D]): mean cosine similarity to the others (the most recent
    key above `threshold` in each row not counted), softmax over the tokens."""
    kf = k.float()
    kn = kf / (kf.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(kn, kn.transpose(-1, -2))  # [H, T, T]
    H, T, _ = sim.shape
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    cols = torch.arange(T, device=k.device)
    last = torch.where(sim > threshold, cols, torch.zeros_like(cols)).amax(dim=-1)  # [H, T] (0 where none)
    sim.scatter_(-1, last[..., None], 0.0)
    return sim.mean(dim=1).softmax(dim=-1)


def rkv_keep(q: torch.Tensor, k: torch.Tensor, budget: int, window: int, kernel: int, mix_lambda: float,
             threshold: float = 0.5, gqa_pooling: str = "max") -> torch.Tensor:
    """The kept slots [H, budget], sorted, of one table of T > budget tokens: the `budget - window` best older
    tokens plus the newest `window` (q [Hq, W, D], k [H, T, D])."""
    H, T, _ = k.shape
    score = (rkv_importance(q, k, window, kernel, gqa_pooling) * mix_lambda
             - rkv_redundancy(k, threshold)[:, : T - window] * (1 - mix_lambda))  # [H, T - window]
    best = score.topk(budget - window, dim=-1).indices  # [H, budget - window]
    recent = torch.arange(T - window, T, device=k.device).expand(H, -1)
    return sort_keep(torch.cat([best, recent], dim=-1), T)


@register_method("rkv")
@dataclass
class RKV(ScorerMethod):
    """Importance (window attention) minus redundancy (key similarity), compressing every `buffer` tokens."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("evict", "none")
    keeps_newest_at_prefill: ClassVar[bool] = True
    decode: str = "evict"
    window: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.07
    buffer: int = 128
    similarity_threshold: float = 0.5
    gqa_pooling: str = "max"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "window", self.window, 1)
        check_int(self.name, "kernel_size", self.kernel_size, 1)
        if self.kernel_size % 2 == 0:
            raise UserError(f"invalid rkv.kernel_size={self.kernel_size}: expected an odd integer >= 1")
        check_int(self.name, "buffer", self.buffer, 0)
        check_float(self.name, "mix_lambda", self.mix_lambda, 0.0, 1.0)
        check_float(self.name, "similarity_threshold", self.similarity_threshold, -1.0, 1.0)
        check_choice(self.name, "gqa_pooling", self.gqa_pooling, GQA_POOLINGS)
        if self.budget is not None and self.budget <= self.window:
            raise UserError(f"invalid budget={self.budget} for method 'rkv': it must exceed rkv.window="
                            f"{self.window} (the observation window is always kept)")

    def min_budget(self) -> int:
        return self.window + 1

    @property
    def query_window(self) -> int:
        return self.window  # declared: obs.queries holds the last `window` queries

    def recent_window(self, budget: int) -> int:
        return self.window

    def decode_interval(self) -> int | None:
        """decode="evict": every `buffer` decode steps (the official code's divide_length), through the one periodic
        policy (methods.eviction.EvictionMethod.evict_every); a table then holds at most budget + buffer - 1 tokens
        after a step (decode_overshoot)."""
        return self.buffer if self.decode == "evict" else super().decode_interval()

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["max_table_tokens"] = None if self.budget is None else self.budget + self.decode_overshoot()
        return d

    def _compress(self, obs: Observation, budget: int) -> None:
        if obs.pre_rope:
            raise UserError("method 'rkv' scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        k = obs.keys  # [H, T, D]
        lengths = obs.lengths.tolist()  # [H]
        q = obs.queries  # [Hq, W, D]
        W = min(self.window, q.shape[1])
        H = len(lengths)
        G = q.shape[0] // H
        keep = torch.full((H, budget), -1, dtype=torch.int64, device=k.device)
        for h in range(H):  # a table's heads hold the same count unless a method mixed them; one by one is exact
            n = lengths[h]
            if n <= budget:
                keep[h, :n] = torch.arange(n, device=k.device)
                continue
            keep[h] = rkv_keep(q[h * G:(h + 1) * G], k[h:h + 1, :n], budget, W, self.kernel_size,
                               self.mix_lambda, self.similarity_threshold, self.gqa_pooling)[0]
        self.keep(obs, keep)

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        if int(obs.lengths.max()) > budget:
            self._compress(obs, budget)

    def reselect(self, obs: Observation, budget: int) -> None:
        self._compress(obs, budget)
