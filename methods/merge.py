"""`merge`: evicted tokens folded into kept ones instead of dropped, over any scorer (kvpress `MergingPress`; CaM's
decode-time merge, kvpress `CAMPress`, as its decode policy).

`method=merge method.base=knorm` (the base's options under `method.base_options`). At prefill (kvpress MergingPress):
each kv-head keeps the base's top `budget` tokens; every evicted token's value is folded into the kept token whose key
is the most cosine-similar to its own, with weight w = max(cos, 0) x ||v_e|| / (||v_e|| + ||v_t|| + 1e-6) (merges
below `similarity_threshold` skipped; with `merge_fraction` < 1 only that most-similar fraction merges); a kept
token that received weights W = sum w becomes (v_t + sum w v_e) / (1 + W), so the layer's weighted value mass
sum_t (1 + W_t) v_t' = sum_t v_t + sum_e w_e v_e is kept whole. Keys are left as they are (RoPE-safe). The kept
values are written back in place (cache.rewrite_tokens), the evicted tokens' blocks freed.

decode="cam" (CaM, Zhang et al., ICML 2024; kvpress CAMPress): while decoding, each layer accumulates the attention
every cached token receives from the generated tokens; every `compression_interval` steps a layer holding more
than its budget per kv-head is brought back to the budget: tokens ranked by the base's scores averaged over the
kv-heads (one token set for the layer), the k best-scored of the evicted ones (k = the steps since the last
merge; ties: the later first) are merged, each into the `merge_budget` kept tokens that
follow it: with probability clamp(A_e / mean A_window, 0, 1) (A: the accumulated attention, per kv-head; a Bernoulli draw from
`seed`) its value / (window size) is added to each of them, so a merged token's value is added whole. kvpress's
defaults: compression_interval 512, merge_budget 32 (compression_interval=1 is the original per-step CaM).
`compress_prompt=false` keeps the prompt whole (no MergingPress at prefill): decode="cam" is then kvpress's CAMPress
alone (its registry rows cam_knorm, cam_tova: the budget is CAMPress's target_size, 2048).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_float, check_int
from kvbench.methods.eviction import DECODE_STEPS
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation

EPS = 1e-6  # kvpress's _EPS


def merged_values(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, similarity_threshold: float = 0.0,
                  merge_fraction: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """kvpress MergingPress.merge for one kv-head: k, v [T, D] its tokens, keep [n] kept slots (sorted).
    Returns (the kept tokens' merged values [n, D], the weight each received [n])."""
    T = k.shape[0]
    evict_mask = torch.ones(T, dtype=torch.bool, device=k.device)
    evict_mask[keep] = False
    evict = evict_mask.nonzero()[:, 0]
    kept_v = v[keep]
    if evict.numel() == 0 or keep.numel() == 0:
        return kept_v, kept_v.new_zeros(keep.numel(), dtype=torch.float32)
    kk, ek = k[keep].float(), k[evict].float()
    kk = kk / kk.norm(dim=-1, keepdim=True).clamp(min=EPS)
    ek = ek / ek.norm(dim=-1, keepdim=True).clamp(min=EPS)
    max_sim, target = (ek @ kk.T).max(dim=-1)  # [E]
    ok = max_sim >= similarity_threshold
    if merge_fraction < 1.0 and bool(ok.any()):
        cut = max_sim.masked_fill(~ok, float("-inf")).quantile(1.0 - merge_fraction, dim=-1, keepdim=True)
        ok = ok & (max_sim >= cut)
    w = max_sim.clamp(min=0) * ok.float()
    ev = v[evict]
    e_norm = ev.float().norm(dim=-1)
    w = w * e_norm / (e_norm + kept_v.float().norm(dim=-1)[target] + EPS)
    acc = torch.zeros(keep.numel(), v.shape[-1], dtype=torch.float32, device=v.device)
    acc.index_add_(0, target, w[:, None] * ev.float())
    wsum = torch.zeros(keep.numel(), dtype=torch.float32, device=v.device).index_add_(0, target, w)
    out = torch.where((wsum > 0)[:, None], ((kept_v.float() + acc) / (1.0 + wsum)[:, None]).to(v.dtype), kept_v)
    return out, wsum


def cam_merge(scores: torch.Tensor, attn: torch.Tensor, v: torch.Tensor, target: int, k: int, merge_budget: int,
              generator: Optional[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """kvpress CAMPress.compress for one layer: scores [H, T] (the base's), attn [H, T] accumulated decode attention,
    v [H, T, D]; keep `target` tokens. Returns (kept slots [target] sorted, the kept tokens' values [H, target, D]
    with the merged tokens' values added)."""
    H, T, D = v.shape
    n_evict = T - target
    mean_scores = scores.float().mean(dim=0)  # [T] one token set for the layer
    evict_idx = mean_scores.topk(n_evict, largest=False).indices.sort().values
    evict_scores = mean_scores[evict_idx]
    order = evict_scores.flip(-1).argsort(descending=True, stable=True)[:k]  # later positions first on ties
    merge_idx = evict_idx[n_evict - 1 - order].sort().values  # [M]
    kept = mean_scores.topk(target).indices.sort().values  # [target]
    starts = torch.searchsorted(kept, merge_idx, right=True)
    window = starts[:, None] + torch.arange(merge_budget, device=v.device)[None, :]  # [M, mb]
    valid = window < target
    targets = kept[window.clamp(max=target - 1)]  # [M, mb] slots
    actual = valid.sum(-1)  # [M]
    w_attn = attn[:, targets] * valid[None]  # [H, M, mb]
    mean_attn = w_attn.sum(-1) / actual.clamp(min=1)[None]
    prob = attn[:, merge_idx] / mean_attn  # [H, M]
    prob = torch.where(torch.isnan(prob), torch.zeros_like(prob), prob)
    prob = torch.where(torch.isinf(prob), torch.ones_like(prob), prob).clamp(0, 1)
    mask = torch.bernoulli(prob, generator=generator)
    scale = (mask / actual[None]).unsqueeze(-1)  # [H, M, 1]
    scale = torch.where(actual[None, :, None] == 0, torch.zeros_like(scale), scale)
    contrib = (v[:, merge_idx] * scale)[:, :, None, :] * valid[None, :, :, None]  # [H, M, mb, D]
    out = v.clone()
    out.index_add_(1, targets.reshape(-1), contrib.reshape(H, -1, D).to(v.dtype))
    return kept, out[:, kept]


@register_method("merge")
@dataclass
class Merge(ScorerWrapper):
    """The base's selection; evicted values folded into their most similar kept token (CaM's merge while decoding)."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none", "cam")
    reselects_by_score: ClassVar[bool] = False  # its decode policy is CaM's merge (decode="cam")
    interval_restarts_within_budget: ClassVar[bool] = False  # CAMPress counts on while a layer is within budget
    base: str = "knorm"
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0
    compression_interval: int = 512
    merge_budget: int = 32
    seed: Optional[int] = None
    compress_prompt: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "compress_prompt", self.compress_prompt)
        check_float(self.name, "similarity_threshold", self.similarity_threshold, 0.0, 1.0)
        check_float(self.name, "merge_fraction", self.merge_fraction, 1e-9, 1.0)
        check_int(self.name, "compression_interval", self.compression_interval, 1)
        check_int(self.name, "merge_budget", self.merge_budget, 1)
        self._generator = torch.Generator().manual_seed(0 if self.seed is None else int(self.seed))

    @staticmethod
    def rewrites_cache(options: dict) -> bool:
        """kvbench.run.spec.check_rewrite_storage: merged values are written in place."""
        return True

    @property
    def needs_key_scores(self) -> bool:
        return self.decode == "cam" or self.inner.needs_key_scores

    def observes_in_decode(self) -> bool:
        return self.decode == "cam" or self.inner.observes_in_decode()

    @property
    def compresses_prompt(self) -> bool:
        """False: the prompt is kept whole (kvpress CAMPress: compression while decoding only)."""
        return bool(self.compress_prompt)

    def budget_holds(self, slot: int, layer: int) -> bool:
        """Whether (slot, layer) is bounded by the budget: after its prompt's compression, or without one once CaM
        merged while decoding (before that it holds the whole prompt)."""
        return self.compress_prompt or bool(self._state.get((slot, layer), {}).get("cam_compressed", False))

    # --- prefill: kvpress MergingPress ------------------------------------------------------------
    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.table_lengths()
        if max(lengths) <= budget or not self.compress_prompt:
            return
        keep = self.select(obs, budget)  # [H, n] the base's top tokens per kv-head
        self.keep_merged(obs, keep, [merged_values(obs.keys[h, :n], obs.values[h, :n], keep[h][keep[h] >= 0],
                                                   self.similarity_threshold, self.merge_fraction)[0]
                                     for h, n in enumerate(lengths)])

    def keep_merged(self, obs: Observation, keep: torch.Tensor, values: list[torch.Tensor]) -> None:
        """Keep `keep` [H, n] and write the kept tokens' merged values (per head [n_h, D]) in place."""
        H, n = keep.shape
        v = obs.values.new_zeros(H, n, obs.values.shape[-1])
        for h, vh in enumerate(values):
            v[h, : vh.shape[0]] = vh
        self.keep(obs, keep)
        obs.cache.rewrite_tokens(obs.layer, obs.slot, values=v)
        obs.refresh()

    # --- decode: CaM ------------------------------------------------------------------------------
    def observe(self, obs: Observation) -> None:
        super().observe(obs)
        if self.decode != "cam" or obs.phase != "decode":
            return
        st = self.state(obs.slot, obs.layer)
        n = max(obs.table_lengths())
        ks = obs.key_scores[:, :n].float()  # [H, n] this step's attention per cached token
        acc = st.get("cam_attn")
        st["cam_attn"] = ks if acc is None else torch.nn.functional.pad(acc, (0, n - acc.shape[-1])) + ks

    def decode_interval(self) -> int | None:
        """decode="cam": kvpress's compression_interval, through the one periodic policy (EvictionMethod.evict_every;
        as CAMPress, a layer within its budget at the interval's end keeps counting: interval_restarts_within_budget)."""
        return self.compression_interval if self.decode == "cam" else None

    def reselect(self, obs: Observation, budget: int) -> None:
        """CaM: the layer merged back to the budget; k = the interval's steps of the evicted tokens are merged."""
        st = self.state(obs.slot, obs.layer)
        lengths = obs.table_lengths()
        T = max(lengths)
        if min(lengths) != T:
            raise RuntimeError(f"{self.name}: CaM merges a layer whose kv-heads hold as many tokens (got {lengths})")
        kept, values = cam_merge(self.score(obs), st["cam_attn"], obs.values, budget, st[DECODE_STEPS],
                                 self.merge_budget, self._generator)
        H = len(lengths)
        self.keep(obs, kept[None].expand(H, -1).contiguous())
        obs.cache.rewrite_tokens(obs.layer, obs.slot, values=values)
        obs.refresh()
        st["cam_attn"], st["cam_compressed"] = st["cam_attn"][:, kept], True
