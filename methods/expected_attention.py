"""`expected_attention`: Expected Attention (Devoto et al., 2025, arXiv 2510.00636; kvpress `ExpectedAttentionPress`).

The attention that *future* queries will pay each cached key, estimated from the statistics of the prompt's queries:
  1. mean mu and covariance Sigma (biased, / N) of the layer's pre-RoPE queries over the prompt, per query head,
     leaving out the first `n_sink` positions (outliers); accumulated across prefill chunks;
  2. the RoPE rotation averaged over the next `n_future_positions` positions (T .. T+n-1 for a prompt of T
     tokens): R = mean_t R_t, and mu <- R mu, Sigma <- R Sigma R^T;
  3. per query head, logit(k) = mu.k / sqrt(d) + k^T Sigma k / (2d) (use_covariance; mu.k / sqrt(d) alone
     otherwise), softmax over the cached keys after the sinks, averaged over the query heads of each kv-head;
  4. with use_vnorm, score = (p + epsilon) * ||v||_2.
The first `n_sink` tokens are always kept; each kv-head keeps its top `budget` tokens (sinks included), by score
alone otherwise (no recent window, as kvpress). Keys are scored as cached (post-RoPE), like kvpress. Defaults are
kvpress's: n_future_positions 512, n_sink 4, use_covariance true, use_vnorm true, epsilon 0. The prompt is
compressed once after prefill (decode="none"). Pre-RoPE queries are recovered from the rotated ones with the model's
RoPE table (exact inverse, attention scaling included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_float, check_int
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.selection import valid_mask
from kvbench.runtime.contract import Observation, RotaryTable, rotate_half


def unrotate(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo apply_rotary: q [..., Q, D] rotated by cos/sin [Q, Dr] (attention scaling s folded into both) -> pre-RoPE.
    The inverse of x*c + rotate_half(x)*s is (y*c - rotate_half(y)*s) / (c^2 + s^2); with partial rotary (Dr < D,
    Phi-4-mini) only the first Dr dims were rotated."""
    Dr = cos.shape[-1]
    if Dr < q.shape[-1]:
        return torch.cat([unrotate(q[..., :Dr], cos, sin), q[..., Dr:]], dim=-1)
    return (q * cos - rotate_half(q) * sin) / (cos * cos + sin * sin)


def averaged_rope(rotary: RotaryTable, start: int, n: int, head_dim: int | None = None) -> torch.Tensor:
    """The RoPE matrix averaged over positions start..start+n-1 -> R [D, D] (float64), R x = mean_t rotate(x, t);
    the identity on the dims past the rotary ones (partial rotary, head_dim > the table's width)."""
    cos, sin = rotary.lookup(torch.arange(start, start + n, device=rotary.inv_freq.device))  # [n, Dr]
    c, s = cos.double().mean(0), sin.double().mean(0)  # [Dr]
    Dr = c.shape[0]
    P = rotate_half(torch.eye(Dr, dtype=torch.float64, device=c.device)).T  # P x = rotate_half(x)
    R = torch.diag(c) + s[:, None] * P
    D = head_dim or Dr
    if D > Dr:
        R = torch.block_diag(R, torch.eye(D - Dr, dtype=torch.float64, device=c.device))
    return R


@register_method("expected_attention")
@dataclass
class ExpectedAttention(ScorerMethod):
    """Expected attention of future queries (query mean/covariance, averaged RoPE), times ||v||."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    n_future_positions: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "n_future_positions", self.n_future_positions, 1)
        check_int(self.name, "n_sink", self.n_sink, 0)
        check_bool(self.name, "use_covariance", self.use_covariance)
        check_bool(self.name, "use_vnorm", self.use_vnorm)
        check_float(self.name, "epsilon", self.epsilon, 0.0, float("inf"))

    def observe(self, obs: Observation) -> None:
        """Accumulate sums of the pre-RoPE prompt queries (positions >= n_sink) and of their outer products."""
        if obs.phase != "prefill":
            return
        if obs.rotary is None:
            raise RuntimeError(f"{self.name}: the runtime gave no RoPE table (LayerContext.rotary)")
        pos = obs.step_query_positions  # [Q]
        cos, sin = obs.rotary.lookup(pos)  # [Q, D]
        q = unrotate(obs.step_queries.float(), cos.float(), sin.float())  # [Hq, Q, D] pre-RoPE
        q = q[:, pos >= self.n_sink].double()  # [Hq, N, D]
        st = self.state(obs.slot, obs.layer)
        if "q_sum" not in st:
            Hq, _, D = q.shape
            st["q_sum"] = q.new_zeros(Hq, D)
            st["q_outer"] = q.new_zeros(Hq, D, D) if self.use_covariance else None
            st["q_count"] = 0
        st["q_sum"] += q.sum(dim=1)
        if self.use_covariance:
            st["q_outer"] += torch.matmul(q.transpose(1, 2), q)  # [Hq, D, D]
        st["q_count"] += q.shape[1]

    def query_statistics(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        """mu [Hq, D] and Sigma [Hq, D, D] (or None) of the future queries, rotated by the averaged RoPE."""
        st = self.state(obs.slot, obs.layer)
        n = max(st.get("q_count", 0), 1)
        mu = st["q_sum"] / n  # [Hq, D]
        cov = st["q_outer"] / n - mu[:, :, None] * mu[:, None, :] if self.use_covariance else None
        R = averaged_rope(obs.rotary, obs.tokens_seen, self.n_future_positions, mu.shape[-1])  # [D, D]
        mu = mu @ R.T
        if cov is not None:
            cov = R @ cov @ R.T
        return mu, cov

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.pre_rope:
            raise UserError(f"method {self.name!r} scores post-RoPE keys; it cannot run on a pre-RoPE cache")
        k, v, lengths = obs.keys, obs.values, obs.lengths  # [H, T, D], [H, T, D], [H]
        H, T, D = k.shape
        mu, cov = self.query_statistics(obs)
        G = mu.shape[0] // H
        kf = k.float()
        mu = mu.float().view(H, G, D)
        logits = torch.einsum("hgd,htd->hgt", mu, kf) / D ** 0.5  # [H, G, T]
        if cov is not None:
            kc = torch.einsum("htd,hgde->hgte", kf, cov.float().view(H, G, D, D))  # [H, G, T, D]
            logits = logits + (kc * kf[:, None]).sum(-1) / D / 2
        scored = valid_mask(lengths, T) & (torch.arange(T, device=k.device) >= self.n_sink)[None, :]  # [H, T]
        probs = torch.softmax(logits.masked_fill(~scored[:, None], float("-inf")), dim=-1)
        s = torch.nan_to_num(probs, nan=0.0).mean(dim=1)  # [H, T] the group's query heads averaged
        if self.use_vnorm:
            s = (s + self.epsilon) * v.float().norm(dim=-1)
        return s.masked_fill(~scored & valid_mask(lengths, T), float("inf"))  # the sinks are always kept

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        super().evict_prefill(obs, budget)
        if obs.last_chunk:  # the prompt is done: its query statistics are no longer needed
            for key in ("q_sum", "q_outer", "q_count"):
                self.state(obs.slot, obs.layer).pop(key, None)
