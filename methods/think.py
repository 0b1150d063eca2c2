"""`think`: ThinK (Xu et al., "ThinK: Thinner Key Cache by Query-Driven Pruning", ICLR 2025; kvpress ThinKPress),
key channels pruned per kv-head, composed with token eviction by any scorer.

`method=think method.key_channel_compression_ratio=0.5 compression_ratio=0.5` (kvpress's
ComposedPress([SnapKVPress(0.5), ThinKPress(0.5)]), its registry's `snap_think`): in each layer, once the prompt is
in the cache, the base (`method.base`, any plain scorer, default snapkv; its options under `method.base_options`)
evicts tokens to the budget as it would alone, then ThinK scores each kv-head's key channels over what stayed:

    score[h, d] = mean_{query heads g of h} mean_{last window_size queries w} q[g, w, d]^2
                  x mean_{kept tokens t} k[h, t, d]^2                    (post-RoPE queries and keys, kvpress)

and prunes the int(head_dim x key_channel_compression_ratio) lowest-scored channels of that kv-head. The cache stores
the pruned blocks in fewer bytes (kvbench.runtime.cache.pruned_key_cache: only the kept channels and their indices;
`peak_kv_bytes` shows it); attention reads zeros in the pruned channels, which is what kvpress computes (it zeroes
them). Tokens appended after the prompt (generated ones, a question appended uncompressed) keep full keys, as in
kvpress. ThinK alone (no token eviction): `compression_ratio=0`.

Defaults are kvpress's: key_channel_compression_ratio 0.0 (kvpress's evaluation requires it set), window_size 32.
The top-level `compression_ratio` is the base's token ratio (kvpress reports ThinKPress's own compression_ratio as
key_channel_compression_ratio / 2, the share of K and V bytes its channels would be). Keys must be cached after
RoPE (a base that stores them before RoPE is refused); a storage codec (`quant=`) is refused (both choose the layout).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_int
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation


def think_channel_scores(queries: torch.Tensor, keys: torch.Tensor,
                         lengths: torch.Tensor | None = None) -> torch.Tensor:
    """ThinKPress's channel scores [H, D]: queries [Hq, W, D] (the window's, after RoPE), keys [H, T, D] (after RoPE;
    slots past lengths [H], when given, are left out of each head's mean)."""
    Hq, _, D = queries.shape
    H = keys.shape[0]
    q_norm = queries.pow(2).mean(dim=1).view(H, Hq // H, D).mean(dim=1)  # [H, D]
    if lengths is None or bool((lengths == keys.shape[1]).all()):
        k_norm = keys.pow(2).mean(dim=1)  # [H, D]
    else:
        valid = torch.arange(keys.shape[1], device=keys.device)[None, :] < lengths[:, None]  # [H, T]
        k_norm = (keys.pow(2) * valid[..., None]).sum(dim=1) / lengths.clamp(min=1)[:, None].to(keys.dtype)
    return q_norm * k_norm


def pruned_channels(scores: torch.Tensor, n_pruned: int) -> torch.Tensor:
    """The n_pruned lowest-scored channels of each kv-head [H, n_pruned] (kvpress: topk(largest=False))."""
    return scores.topk(n_pruned, dim=-1, largest=False).indices


@register_method("think")
@dataclass
class ThinK(ScorerWrapper):
    """The base evicts tokens; then each kv-head's lowest-scored key channels are pruned (stored in fewer bytes)."""

    base: str = "snapkv"
    decode: str = "none"
    key_channel_compression_ratio: float = 0.0
    window_size: int = 32

    def __post_init__(self) -> None:
        r = self.key_channel_compression_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise UserError(f"invalid think.key_channel_compression_ratio={r!r}: expected a number in [0, 1) (the "
                            "fraction of each kv-head's key channels pruned)")
        check_int(self.name, "window_size", self.window_size, 1)
        super().__post_init__()
        if self.inner.store_pre_rope:
            base = self.base_name()
            raise UserError(f"invalid think.base={base!r}: ThinK prunes keys after RoPE, {base} caches them before")

    @staticmethod
    def rewrites_cache(options: dict) -> bool:
        """kvbench.run.spec.check_rewrite_storage: the pruned keys are stored in a layout of ThinK's own."""
        return True

    def pruned_key_channels(self, head_dim: int) -> int:
        """The hook protocol's: channels pruned per kv-head (kvpress: int(head_dim x ratio))."""
        return int(head_dim * self.key_channel_compression_ratio)

    # --- the window's queries (ThinK's own, beside the base's) --------------------------------------
    def observe(self, obs: Observation) -> None:
        super().observe(obs)
        if obs.phase != "prefill" or obs.step_queries is None:
            return
        st = self.state(obs.slot, obs.layer)
        q = obs.step_queries  # [Hq, Q, D]
        if "think_q" in st:
            q = torch.cat([st["think_q"], q], dim=1)
        st["think_q"] = q[:, -self.window_size:].clone()

    # --- the base evicts, then ThinK prunes ------------------------------------------------------------
    def evict_prefill(self, obs: Observation, budget: int) -> None:
        self.inner.evict_prefill(obs, budget)
        obs.refresh()
        if obs.last_chunk:
            self.prune(obs)

    def evict_decode(self, obs: Observation, budget: int) -> None:
        self.inner.evict_to_budget(obs, budget)

    def prune(self, obs: Observation) -> None:
        """Prune obs's layer's key channels (the prompt is in the cache, the base has evicted)."""
        n = self.pruned_key_channels(obs.head_dim)
        q = self.state(obs.slot, obs.layer).get("think_q")
        if n == 0 or q is None:
            return
        scores = think_channel_scores(q.float(), obs.keys.float(), obs.lengths)
        obs.cache.prune_key_channels(obs.layer, obs.slot, pruned_channels(scores, n))
        obs.refresh()
