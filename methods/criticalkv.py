"""`criticalkv`: CriticalKV (Feng et al., 2025, arXiv:2502.03805), output-perturbation re-weighting of any scorer.

`method=criticalkv method.base=snapkv` (the base's options under `method.base_options`). A cached token's effect
on the layer's output is its attention weight times the size of what it adds: CriticalKV re-weights the base's
score by the projected value norm ||W_o v||_1 (the L1 norm of the token's value through the output projection of
each query head, averaged over the query heads of its kv-head) in two stages, as kvpress's CriticalKVPress:
  stage 1: each kv-head keeps its int(first_stage_ratio x n) best tokens by the base's score alone;
  stage 2: the rest of its n tokens by (score + epsilon) x ||W_o v||_1.
epsilon is added on kvpress's scale of the base's scores (the base's `score_scale`: snapkv sums its window's
attention over the window and the GQA group, kvpress's SnapKVPress averages both, so its scores are divided by
window x group first); on the summed scale epsilon would count window x group times less.
head_adaptive=false (default; kvpress `critical_snapkv`, CriticalKVPress): n = budget for every kv-head.
head_adaptive=true (kvpress `critical_adakv_snapkv`, CriticalAdaKVPress; the paper's main setting): the layer's
kv_heads x budget tokens are first allocated across its kv-heads jointly by the base's scores (each head keeping
at least int(alpha_safeguard x budget), as adakv), then each head runs the two stages with its own n; the tables
really hold different numbers of tokens (and blocks). The base's recent window (SnapKV's observation window)
stays in every head in both stages. Defaults are kvpress's: epsilon 1e-4, first_stage_ratio 0.5,
alpha_safeguard 0.20. Decoding (`decode`): "none" (default, kvpress: the prompt is compressed once) or "evict".
W_o comes from the engine's model (the optional `bind_engine` hook).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_float
from kvbench.methods.selection import valid_mask
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation


def projected_value_norms(v: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """||W_o v||_1 per kv-head and token, averaged over the query heads of each kv-head (kvpress vwl1norm).

    v [H, T, D] values as cached; w_o [E, Hq * D] the output projection ([out, in]) -> [H, T]."""
    H, T, D = v.shape
    E = w_o.shape[0]
    G = w_o.shape[1] // (H * D)
    w = w_o.view(E, H, G, D).permute(1, 2, 3, 0)  # [H, G, D, E]: query head (h, g) reads its slice of W_o^T
    out = torch.empty(H, T, dtype=torch.float32, device=v.device)
    for h in range(H):  # one kv-head at a time: [G, T, E] at most
        out[h] = torch.matmul(v[h].float(), w[h].float()).abs().sum(-1).mean(0)
    return out


def _first_ranked(scores: torch.Tensor, tier: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Mask [H, T] of the first n[h] tokens of each head ranked by tier (higher first), then score (higher first)."""
    by_score = scores.argsort(dim=-1, descending=True, stable=True)
    by_tier = tier.gather(-1, by_score).argsort(dim=-1, descending=True, stable=True)
    order = by_score.gather(-1, by_tier)  # [H, T] slots, best first
    ranks = torch.arange(scores.shape[-1], device=scores.device)[None, :].expand_as(order)
    return torch.zeros_like(tier, dtype=torch.bool).scatter(-1, order, ranks < n[:, None])


@register_method("criticalkv")
@dataclass
class CriticalKV(ScorerWrapper):
    """The base's scores re-weighted by ||W_o v||_1 in two stages; per-head or head-adaptive budgets."""

    head_adaptive: bool = False  # type: ignore[assignment]
    epsilon: float = 1e-4
    first_stage_ratio: float = 0.5
    alpha_safeguard: float = 0.20

    def tensor_parallel_refusal(self) -> str | None:
        if self.head_adaptive:
            return ("head_adaptive=true allocates the budget across every kv-head of a layer inside its score, "
                    "which a kv-head shard does not hold (use criticalkv.head_adaptive=false)")
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "head_adaptive", self.head_adaptive)
        check_float(self.name, "epsilon", self.epsilon, 0.0, float("inf"))
        check_float(self.name, "first_stage_ratio", self.first_stage_ratio, 0.0, 1.0)
        check_float(self.name, "alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)

    def min_tokens_per_head(self, budget: int) -> int:
        return int(budget * self.alpha_safeguard)

    def _w_o(self, layer: int) -> torch.Tensor:
        engine = getattr(self, "engine", None)
        if engine is None:
            raise RuntimeError("criticalkv needs the engine's model (W_o): the engine calls bind_engine")
        return engine.model.layers[layer].o.dense_weight()  # [E, Hq * D]

    def select(self, obs: Observation, budget: int, scores: torch.Tensor | None = None) -> torch.Tensor:
        """The wrapper's selection over the two-stage mask (critical_mask): exactly its tokens per head."""
        return super().select(obs, budget, self.critical_mask(obs, budget) if scores is None else scores)

    def critical_mask(self, obs: Observation, budget: int) -> torch.Tensor:
        """[H, T] 1.0 for the tokens CriticalKV keeps, else 0.0 (the selection's scores)."""
        layer = obs.layer
        # on kvpress's scale (SnapKV: means over the window, not sums), which epsilon is relative to
        base = self.inner.score(obs).float() * self.inner.score_scale(obs)  # [H, T]
        lengths = obs.lengths  # [H]
        H, T = base.shape
        valid = valid_mask(lengths, T)
        recent = self.recent_kept(obs, budget)
        protect = valid & (torch.arange(T, device=base.device)[None, :] >= (lengths[:, None] - recent))
        base = base.clamp(max=torch.finfo(torch.float32).max)  # the scorer's +inf: finite, ranked by tier below
        if self.head_adaptive:  # the layer's kv_heads x budget allocated jointly by the base's scores
            s = base.masked_fill(protect, float("inf")).masked_fill(~valid, float("-inf"))
            safe = s.topk(min(self.min_tokens_per_head(budget), T), dim=-1).indices
            s = s.scatter(-1, safe, float("inf"))
            total = min(H * budget, int(lengths.sum()))
            picked = s.reshape(-1).topk(total).indices // T
            n_head = torch.bincount(picked, minlength=H)  # [H] tokens each kv-head keeps
        else:
            n_head = torch.clamp(lengths, max=budget)
        norms = projected_value_norms(obs.values, self._w_o(layer))  # values [H, T, D] -> [H, T]
        first = (n_head.float() * self.first_stage_ratio).long()  # kvpress: int(n * first_stage_ratio),
        if self.first_stage_ratio > 0:  # at least 1 (CriticalKVPress) where a head keeps any
            first = torch.where(n_head > 0, first.clamp(min=1), first)
        invalid = torch.full_like(base, float("-inf"))
        s1 = torch.where(valid, base, invalid)
        stage1 = _first_ranked(s1, protect.long(), first)  # stage 1: the base's order, recent window first
        s2 = torch.nan_to_num((base.clamp(max=1e30) + self.epsilon) * norms, nan=0.0)  # inf x 0 -> 0
        s2 = torch.where(valid, s2, invalid)
        kept = _first_ranked(s2, 2 * protect.long() + stage1.long(), n_head) & valid  # stage 2
        return kept.float()  # the selection as scores: the inherited top-k keeps exactly these n_head per head

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if not self.head_adaptive:
            d.pop("alpha_safeguard", None)
        return d
