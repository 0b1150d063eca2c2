"""Multi-head latent attention (DeepSeek-V2 / V3): what the cache holds and how queries read it.

    MLAConfig(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)
    MLAWeights(q or q_a/q_a_norm/q_b, kv_a, kv_a_norm, w_uk [Hq, nope, r], w_uv [Hq, v, r])
    rope_interleaved(x, cos, sin)          DeepSeek's RoPE: adjacent pairs (x0, x1) rotated (complex product)
    project(model, lw, h, cos, sin)        -> q [N, Hq, r + rope] (absorbed), kv [N, r + rope] (the cache row)
    expand_out(lw, out_latent)            -> [N, Hq * v] from the attention over the latents

The cache keeps, per token and layer, one row [c_kv (kv_lora_rank, after kv_a_layernorm) ; k_pe (qk_rope_head_dim,
rotated)]: one "kv-head" of width r + rope whose values are its first r dims (PagedKVCache value_dim=r). Attention
uses the absorbed form at every step: q_nope is projected into the latent space by kv_b_proj's key half (W_UK), so
the scores q_nope . (W_UK c) + q_pe . k_pe are q_absorbed . row, and the output W_UV (sum_t p_t c_t); transformers'
eager forward expands every cached latent into per-head keys and values instead (the same sums, regrouped).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvbench.runtime.backends.cpu.linear import Linear


@dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int  # r: the compressed latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the decoupled RoPE key's width
    v_head_dim: int
    q_lora_rank: Optional[int] = None  # None: one q projection (V2-Lite)

    @property
    def row_dim(self) -> int:
        """Width of one cached row: latent + RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class MLAWeights:
    kv_a: Linear  # E -> r + rope
    kv_a_norm: torch.Tensor  # [r]
    w_uk: torch.Tensor  # [Hq, nope, r]: kv_b_proj's key rows
    w_uv: torch.Tensor  # [Hq, v, r]: kv_b_proj's value rows
    q: Optional[Linear] = None  # E -> Hq * (nope + rope) (no q_lora_rank)
    q_a: Optional[Linear] = None  # E -> q_lora_rank
    q_a_norm: Optional[torch.Tensor] = None
    q_b: Optional[Linear] = None  # q_lora_rank -> Hq * (nope + rope)

    @property
    def nbytes(self) -> int:
        parts = (self.kv_a, self.kv_a_norm, self.w_uk, self.w_uv, self.q, self.q_a, self.q_a_norm, self.q_b)
        return sum(p.nbytes for p in parts if p is not None)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., R] rotated as DeepSeek does (x viewed as R/2 complex numbers of adjacent pairs, times e^{i theta_j});
    cos / sin [..., R] from a RotaryTable (halves duplicated: theta_j at j and j + R/2)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)


def project(mla: MLAConfig, w: MLAWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: Any,
            eps: float, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [N, E], cos / sin [N, rope] -> (q [N, Hq, r + rope]: absorbed query, row [N, r + rope]: the cache row)."""
    N = h.shape[0]
    q = w.q(h) if w.q is not None else w.q_b(norm(w.q_a(h), w.q_a_norm, eps))
    q = q.view(N, num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    kv = w.kv_a(h)  # [N, r + rope]
    c, k_pe = kv.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    c = norm(c.contiguous(), w.kv_a_norm, eps)
    q_pe = rope_interleaved(q_pe, cos[:, None], sin[:, None])
    k_pe = rope_interleaved(k_pe, cos, sin)
    q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w.w_uk)  # [N, Hq, r]
    return torch.cat([q_lat, q_pe], dim=-1), torch.cat([c, k_pe], dim=-1)


def expand_out(w: MLAWeights, out_latent: torch.Tensor) -> torch.Tensor:
    """out_latent [N, Hq, r] (attention over the latents) -> [N, Hq * v] through W_UV."""
    out = torch.einsum("nhr,hvr->nhv", out_latent, w.w_uv)
    return out.reshape(out.shape[0], -1)
