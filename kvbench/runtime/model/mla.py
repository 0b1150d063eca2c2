"""Multi-head latent attention (DeepSeek-V2 / V3): what the cache holds and how queries read it.

    MLAConfig(kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, q_lora_rank)
    MLAWeights(q or q_a/q_a_norm/q_b, kv_a, kv_a_norm, w_uk [Hq, nope, r], w_uv [Hq, v, r])
    rope_interleaved(x, cos, sin)          DeepSeek's RoPE: adjacent pairs (x0, x1) rotated (complex product)
    project(model, lw, h, cos, sin)        -> q_nope [N, Hq, nope], q_pe [N, Hq, rope], kv [N, r + rope] (the cache row)
    absorb(w, q_nope, q_pe)                -> q [N, Hq, r + rope]: the absorbed query (decode)
    attend_expanded(mla, w, q_nope, q_pe, k_pool, ...) -> out [S, Hq, Q, v]: multi-head attention over expanded K/V
    expand_out(lw, out_latent)            -> [N, Hq * v] from the attention over the latents

The cache keeps, per token and layer, one row [c_kv (kv_lora_rank, after kv_a_layernorm) ; k_pe (qk_rope_head_dim,
rotated)]: one "kv-head" of width r + rope whose values are its first r dims (PagedKVCache value_dim=r). Two forms
of the same attention read it, as DeepSeek's serving does:
- absorbed (decode, one query per sequence): q_nope is projected into the latent space by kv_b_proj's key half
  (W_UK), so the scores q_nope . (W_UK c) + q_pe . k_pe are q_absorbed . row, and the output W_UV (sum_t p_t c_t):
  each cached row is read once, no per-head key or value is built.
- expanded (multi-token steps: prefill chunks): every cached latent is expanded into per-head keys [W_UK c ; k_pe]
  and values W_UV c and the queries [q_nope ; q_pe] attend in the ordinary multi-head form (as transformers' eager
  forward does): with many queries per sequence the expansion costs less than absorbing every query, and the
  attention's head width is nope + rope, not r + rope.
The two are the same sums, regrouped (tests/runtime/test_architectures.py checks they agree).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.backends.torch.attention import gather_blocks


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
            eps: float, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [N, E], cos / sin [N, rope] -> (q_nope [N, Hq, nope], q_pe [N, Hq, rope] rotated, row [N, r + rope]: the
    cache row)."""
    N = h.shape[0]
    q = w.q(h) if w.q is not None else w.q_b(norm(w.q_a(h), w.q_a_norm, eps))
    q = q.view(N, num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
    kv = w.kv_a(h)  # [N, r + rope]
    c, k_pe = kv.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    c = norm(c.contiguous(), w.kv_a_norm, eps)
    q_pe = rope_interleaved(q_pe, cos[:, None], sin[:, None])
    k_pe = rope_interleaved(k_pe, cos, sin)
    return q_nope, q_pe, torch.cat([c, k_pe], dim=-1)


def absorb(w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """q_nope [..., Hq, nope], q_pe [..., Hq, rope] -> the absorbed query [..., Hq, r + rope] (W_UK^T q_nope ; q_pe)."""
    q_lat = torch.einsum("...hd,hdr->...hr", q_nope, w.w_uk)  # [..., Hq, r]
    return torch.cat([q_lat, q_pe], dim=-1)


def attend_expanded(mla: MLAConfig, w: MLAWeights, q_nope: torch.Tensor, q_pe: torch.Tensor, k_pool: torch.Tensor,
                    tables: torch.Tensor, lengths: torch.Tensor, key_positions: torch.Tensor,
                    query_positions: torch.Tensor, scale: float, *, return_key_scores: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The expanded form over a latent pool: q_nope [S, Hq, Q, nope], q_pe [S, Hq, Q, rope]; k_pool [N, bs, r + rope]
    (the rows), tables [S, 1, MB], lengths [S, 1], key_positions [S, 1, MB*bs], query_positions [S, Q].
    Every cached row t becomes per-head K_t = [W_UK c_t ; k_pe_t] [Hq, nope + rope] and V_t = W_UV c_t [Hq, v];
    query p sees the keys at positions <= p. Returns (out [S, Hq, Q, v], key_scores [S, 1, T] or None: the attention
    probability each row received, summed over heads and queries, as the absorbed form's backend gives it)."""
    S, Hq, Q, _ = q_nope.shape
    r, bs = mla.kv_lora_rank, k_pool.shape[1]
    T = int(lengths.max())
    nb = -(-T // bs)
    Tp = nb * bs
    rows = gather_blocks(k_pool, tables, nb)[:, 0]  # [S, Tp, r + rope]
    c, k_pe = rows[..., :r], rows[..., r:]
    k_nope = torch.einsum("str,hdr->shtd", c, w.w_uk)  # [S, Hq, Tp, nope]
    k = torch.cat([k_nope, k_pe[:, None].expand(S, Hq, Tp, k_pe.shape[-1])], dim=-1)  # [S, Hq, Tp, nope + rope]
    v = torch.einsum("str,hvr->shtv", c, w.w_uv)  # [S, Hq, Tp, v]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [S, Hq, Q, nope + rope]
    kp = key_positions[:, 0, :Tp]  # [S, Tp]
    vis = kp[:, None, :] <= query_positions[:, :, None]  # [S, Q, Tp]
    vis &= (torch.arange(Tp, device=q.device) < lengths[:, 0, None])[:, None, :]
    mask = vis[:, None]  # [S, 1, Q, Tp]
    if not return_key_scores:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return torch.nan_to_num(out, nan=0.0), None  # rows that see no key (padded queries) give NaN in SDPA
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [S, Hq, Q, Tp]
    probs = torch.nan_to_num(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), nan=0.0)
    out = torch.matmul(probs.to(v.dtype), v)  # [S, Hq, Q, v]
    return out, probs.sum(dim=(1, 2))[:, None, :T]


def expand_out(w: MLAWeights, out_latent: torch.Tensor) -> torch.Tensor:
    """out_latent [N, Hq, r] (attention over the latents) -> [N, Hq * v] through W_UV."""
    out = torch.einsum("nhr,hvr->nhv", out_latent, w.w_uv)
    return out.reshape(out.shape[0], -1)
