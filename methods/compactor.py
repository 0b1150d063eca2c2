"""`compactor` and `adakv_compactor`: Compactor (Chari & Van Durme, 2025, arXiv 2507.08143; kvpress `CompactorPress`).

Query-agnostic prompt compression, scored once after prefill from two z-normalised scores of the prompt (the first
`sink_size_start` and last `sink_size_end` tokens are left out of both and always kept):
  leverage        approximate statistical leverage of each pre-RoPE key (kvpress LeverageScorePress): the keys,
                  centred over the sequence, times a right Gaussian sketch Phi [D, sketch_dimension] / sqrt(k);
                  scores = diag(X (X^T X)^-1 X^T) through a Cholesky solve (jitter 1e-2, x10 per failed try),
                  clamped at 0, then z-normalised over the layer (every kv-head and token together);
  non-causal      chunked non-causal attention (kvpress NonCausalAttnPress): the prompt is cut into chunks of
                  `chunk_size` tokens; each chunk's (post-RoPE) queries attend to the same chunk's keys, unscaled
                  logits, no causal mask (the last chunk padded as kvpress pads it); the probabilities are summed
                  over the queries, averaged over the query heads of a kv-head, times ||v||, avg-pooled (kernel 3)
                  and z-normalised over the layer;
  score = blending x leverage + non-causal, with `blending` = the compression ratio by default (kvpress).
Each kv-head keeps its top tokens by that score (`compactor`) or, as the leaderboard runs it, a layer keeps its
kv_heads x budget best (kv-head, token) pairs jointly (`adakv_compactor`: kvpress AdaKVPress(CompactorPress()),
Ada-KV's safeguard alpha 0.20). With `budget=N` instead of a ratio the blending is the prompt's realized ratio
1 - N / prompt length. The sketch is drawn from `seed` and the layer (kvpress draws it from the global generator).
Prefill only (kvpress: "Currently only supports prefill"): decode="none". prefill_mode="streaming" (not kvpress)
scores what each table holds after every chunk, each kept token with its own query. The prefill queries are held
per (sequence, layer) by position until the sequence ends (a later prompt of the same sequence, as the scorer's
chunks, scores the tokens kept before with their queries; a token whose query was never seen, a generated token or
a prefix-cache hit, attends as a zero query).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_float, check_int
from kvbench.methods.expected_attention import unrotate
from kvbench.methods.scorer import ScorerMethod
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation, rotate_half


def chol_with_jitter(G: torch.Tensor, jitter: float = 1e-2, max_tries: int = 5) -> torch.Tensor:
    """Cholesky factor of G [..., k, k], adding jitter x I (x10 per failed try) until it succeeds (kvpress)."""
    eye = torch.eye(G.shape[-1], device=G.device, dtype=G.dtype)
    cur = float(jitter)
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(G + cur * eye, upper=False)
        if bool((info == 0).all()):
            return L
        cur = max(1e-8, (1e-2 if cur == 0.0 else 10.0 * cur))
    raise RuntimeError(f"compactor: Cholesky failed after {max_tries} tries")


def leverage_scores(keys: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """Approximate leverage [H, S] of pre-RoPE keys [H, S, D] under the sketch phi [H, D, k] (already / sqrt(k))."""
    X = keys - keys.mean(dim=-2, keepdim=True)
    X = torch.matmul(X, phi.to(X.dtype)).float()  # [H, S, k]
    XT = X.transpose(-2, -1)
    G = XT @ X  # [H, k, k]
    L = chol_with_jitter(0.5 * (G + G.transpose(-2, -1)))
    inv_xt = torch.cholesky_solve(XT, L, upper=False)  # (X^T X)^-1 X^T [H, k, S]
    return (X * inv_xt.transpose(-2, -1)).sum(dim=-1).clamp_min(0)


def non_causal_chunked_attention(q: torch.Tensor, k: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Column sums [Hq, S] of chunked non-causal attention: q [Hq, S, D] (post-RoPE), k [Hq, S, D] (repeated per
    query head). kvpress's tiling: zero-padded to a multiple of chunk_size; in the last chunk the padded query rows'
    logits are 0 and the padded key columns' -1e-9 (so padding takes some mass, as in kvpress)."""
    H, S, D = k.shape
    S_pad = math.ceil(S / chunk_size) * chunk_size
    pad = S_pad - S
    if pad > 0:
        q = torch.cat([q, q.new_zeros(H, pad, D)], dim=1)
        k = torch.cat([k, k.new_zeros(H, pad, D)], dim=1)
        last = (S // chunk_size) * chunk_size
    else:
        last = ((S - 1) // chunk_size) * chunk_size
    mask = (torch.arange(last, S_pad, device=q.device) >= S)  # [chunk] padded positions of the last chunk
    n = S_pad // chunk_size
    dots = torch.matmul(q.view(H, n, chunk_size, D), k.view(H, n, chunk_size, D).transpose(-2, -1))  # [H, n, c, c]
    dots[:, -1].masked_fill_(mask[None, :, None], 0)
    dots[:, -1].masked_fill_(mask[None, None, :], -1e-9)
    attn = torch.softmax(dots.float(), dim=-1)
    return attn.sum(dim=-2).reshape(H, S_pad)[:, :S]


def znorm(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """(x - mean) / std over every element of every head's x (kvpress's z-scores span the layer's heads and tokens;
    heads here may hold different numbers of tokens)."""
    flat = torch.cat(xs)
    mean, std = flat.mean(), flat.std().clamp_min(1e-6)
    return [(x - mean) / std for x in xs]


def compactor_scores(q: list[torch.Tensor], k_rot: list[torch.Tensor], k_pre: list[torch.Tensor],
                     v: list[torch.Tensor], phi: torch.Tensor, blending: float, chunk_size: int, sink_start: int,
                     sink_end: int) -> list[torch.Tensor]:
    """Compactor's score [S_h] of each kv-head h's tokens: q[h] [G, S_h, D] the post-RoPE queries of its tokens (its
    G query heads), k_rot[h] / k_pre[h] [S_h, D] post- and pre-RoPE keys, v[h] [S_h, D]; phi [H, D, k]. A head's
    first sink_start and last sink_end tokens get the layer's largest score."""
    lev, att, cuts = [], [], []
    for h, kp in enumerate(k_pre):
        S = kp.shape[0]
        left = min(sink_start, S)
        right = min(sink_end, max(0, S - left))
        sl = slice(left, S - right)
        cuts.append((left, right))
        lev.append(leverage_scores(kp[None, sl].float(), phi[h: h + 1])[0])
        G = q[h].shape[0]
        A = non_causal_chunked_attention(q[h][:, sl].float(), k_rot[h][None, sl].float().expand(G, -1, -1),
                                         chunk_size).mean(dim=0)  # [S']
        a = A * v[h][sl].float().norm(dim=-1)
        att.append(F.avg_pool1d(a[None, None], kernel_size=3, padding=1, stride=1)[0, 0])
    blended = [blending * x + y for x, y in zip(znorm(lev), znorm(att))]
    top = float(torch.cat(blended).max())
    return [F.pad(s, (left, right), value=top) for s, (left, right) in zip(blended, cuts)]


@dataclass
class CompactorScores:
    """Compactor's options and score (a mixin before ScorerMethod)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    sink_size_start: int = 8
    sink_size_end: int = 4
    chunk_size: int = 256
    sketch_dimension: int = 48
    blending: Optional[float] = None
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sink_size_start", self.sink_size_start, 0)
        check_int(self.name, "sink_size_end", self.sink_size_end, 0)
        check_int(self.name, "chunk_size", self.chunk_size, 1)
        check_int(self.name, "sketch_dimension", self.sketch_dimension, 1)
        if self.blending is not None:
            check_float(self.name, "blending", self.blending, 0.0, float("inf"))

    def observe(self, obs: Observation) -> None:
        """Keep every prompt query and its position (the non-causal attention needs the query of every cached
        token), for as long as the sequence lives."""
        if obs.phase != "prefill":
            return
        st = self.state(obs.slot, obs.layer)
        st.setdefault("prompt_q", []).append(obs.step_queries.clone())  # [Hq, Q, D] post-RoPE
        st.setdefault("prompt_q_pos", []).append(obs.step_query_positions.clone())  # [Q]

    def blending_for(self, prompt_len: int) -> float:
        if self.blending is not None:
            return float(self.blending)
        if self.compression_ratio is not None:
            return float(self.compression_ratio)
        return max(0.0, 1.0 - self.budget / max(prompt_len, 1))  # the realized ratio of budget=N

    def sketch(self, layer: int, H: int, D: int, device) -> torch.Tensor:
        """The right Gaussian sketch Phi [H, D, k] / sqrt(k) of a layer, drawn from seed and layer."""
        g = torch.Generator().manual_seed((0 if self.seed is None else int(self.seed)) * 1_000_003 + layer)
        k = self.sketch_dimension
        return (torch.randn(H, D, k, generator=g) * (1 / math.sqrt(k))).to(device)  # kvpress's scaling

    def prompt_queries(self, obs: Observation, n_pos: int) -> torch.Tensor:
        """The prefill queries seen so far [Hq, n_pos, D] by position (zero rows for a position whose query was
        never seen: a prefix-cache hit, a generated token); kept for the sequence's later prompts (a scorer's
        chunks each end a prompt)."""
        st = self.state(obs.slot, obs.layer)
        qs, ps = st.get("prompt_q", []), st.get("prompt_q_pos", [])
        if not qs:
            raise RuntimeError(f"{self.name}: scores a prompt at prefill (no prompt queries held)")
        pos = torch.cat(ps).long()
        q = torch.cat(qs, dim=1)
        n = max(n_pos, int(pos.max()) + 1)
        out = q.new_zeros(q.shape[0], n, q.shape[2])
        out[:, pos] = q
        st["prompt_q"], st["prompt_q_pos"] = [out], [torch.arange(n, device=pos.device)]
        return out

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.rotary is None:
            raise RuntimeError(f"{self.name}: the runtime gave no RoPE table (LayerContext.rotary)")
        k, v, pos = obs.keys, obs.values, obs.positions  # [H, T, D], [H, T, D], [H, T]
        H, T, D = k.shape
        q = self.prompt_queries(obs, int(pos.max()) + 1)  # [Hq, P, D]
        G = q.shape[0] // H
        lengths = obs.table_lengths()
        qh, kr, kp, vh = [], [], [], []
        for h in range(H):
            n = lengths[h]
            p = pos[h, :n]
            cos, sin = obs.rotary.lookup(p)  # [n, D]
            cos, sin = cos.float(), sin.float()
            kh = k[h, :n].float()
            if obs.pre_rope:
                kp.append(kh)
                kr.append(kh * cos + rotate_half(kh) * sin)
            else:
                kr.append(kh)
                kp.append(unrotate(kh, cos, sin))
            qh.append(q[h * G: (h + 1) * G, p])  # [G, n, D]
            vh.append(v[h, :n])
        per_head = compactor_scores(qh, kr, kp, vh, self.sketch(obs.layer, H, D, k.device),
                                    self.blending_for(obs.tokens_seen), self.chunk_size, self.sink_size_start,
                                    self.sink_size_end)
        out = torch.full((H, T), float("-inf"), device=k.device)
        for h, s in enumerate(per_head):
            out[h, : s.shape[0]] = s
        return out


@register_method("compactor")
@dataclass
class Compactor(CompactorScores, ScorerMethod):
    """Leverage of the pre-RoPE keys blended with chunked non-causal attention; top tokens per kv-head."""

    decode: str = "none"


@register_method("adakv_compactor")
@dataclass
class AdaKVCompactor(ScorerWrapper):
    """The leaderboard's `adakv_compactor`: Ada-KV's joint allocation (methods/adakv.py) over Compactor's scores."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    head_adaptive: ClassVar[bool] = True
    base: str = "compactor"
    alpha_safeguard: float = 0.20

    def __post_init__(self) -> None:
        if self.base_name() != "compactor":
            raise UserError(f"invalid adakv_compactor.base={self.base_name()!r}: it is adakv over compactor (use "
                            "method=adakv method.base=... for another base)")
        super().__post_init__()
        check_float(self.name, "alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)

    def min_tokens_per_head(self, budget: int) -> int:
        return int(budget * self.alpha_safeguard)  # kvpress AdaKVPress: int(n_kept * alpha_safeguard)
