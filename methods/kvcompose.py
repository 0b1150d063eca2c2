"""`kvcompose`: KVCompose (arXiv 2509.05165), kvpress `KVComposePress`: attention-guided eviction with composite
tokens, the budget over all layers.

After the prompt is prefilled, the prompt itself runs again as queries over the cache (positions after it; each
query attends over the whole prompt and the repeated tokens up to itself, causally). Per query head, a prompt
token's score is the max (agg_task) over those queries of the attention probability it gets; a kv-head's score is
the mean (agg_group) over its GQA group; the mean over the layer's kv-heads is added (add_mean_across_heads).
  * structured (kvpress's default, the registry's `kvcompose`): a layer's composite score at rank r is the mean
    (agg_head) over its kv-heads of each head's r-th best score; layer 0's composite is set to the max over the
    layers; the layers x budget best (layer, rank) pairs over all layers give each layer's count, and every kv-head
    of the layer keeps its own that-many best tokens (the same count in each head, different tokens).
  * structured=False (`kvcompose_unstructured`): the layers x kv_heads x budget best (layer, kv-head, rank) give
    each head its own count. kvpress masks the evicted keys; here the tables really shrink.
The repeated prompt goes through the engine as KVzip's reconstruction does (methods/kvzip.py: Engine.forward_chunk
with scratch=True, dropped afterwards): the pool's peak holds one extra copy of the prompt chunk by chunk, as
kvpress's cache of about twice the context. With compression_ratio r each table's budget is int(T x (1 - r)),
so L x budget (L x H x budget unstructured) are kept where kvpress keeps int(L x T x (1 - r)): the same at
r = 0.5 and an even T (kvzip's rule). With prefill_mode=streaming each chunk is repeated as it arrives (its
queries see the cache so far). Decoding appends (decode=none, kvpress).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_choice, check_int
from kvbench.methods.kvzip import KVzip
from kvbench.methods.selection import valid_mask
from kvbench.runtime.contract import Observation, tp_size_of

AGGREGATES = ("mean", "max")
SCORES = "query_head_scores"  # per-layer state: [H, G, T] each query head's max over the repeated prompt's queries
# (not "scores", which EvictionMethod's hooks read as [H, T])


def repeat_attention_max(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor,
                         lengths: torch.Tensor, scale: float, context_len: int) -> torch.Tensor:
    """Max over the repeated prompt's queries of each query head's attention to the prompt's keys -> [H, G, T]
    (0 at keys past the prompt).

    q [Hq, Q, D] the repeated tokens' queries (post-RoPE) at positions q_pos [Q] (>= context_len); k [H, T, D]
    cached keys at positions k_pos [H, T]; lengths [H]. Each query's softmax runs over the prompt's keys
    (positions < context_len) and the repeated tokens' keys up to its own position."""
    Hq, Q, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    logits = torch.matmul(q.reshape(H, G * Q, D).float(), k.float().transpose(-1, -2)) * scale  # [H, G*Q, T]
    kp = k_pos[:, None, :]  # [H, 1, T]
    prompt = (kp >= 0) & (kp < context_len)
    seen = (prompt | ((kp >= context_len) & (kp <= q_pos.repeat(G)[None, :, None]))) & valid_mask(lengths, T)[:, None]
    probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), dim=-1)
    probs = probs.masked_fill(~(prompt & valid_mask(lengths, T)[:, None]), 0.0)
    return probs.view(H, G, Q, T).amax(dim=2)  # [H, G, T]


def kvcompose_keep(scores: torch.Tensor, lengths: torch.Tensor, n_kept: int, *, structured: bool,
                   agg_head: str = "mean", keep_token_lower_bound: int = 0) -> torch.Tensor:
    """KVComposePress's selection (compute_important_per_layer + prepare_important_masks) -> kept [L, H, T] bool.

    scores [L, H, T] (each kv-head's enhanced scores; slots past lengths [L, H] ignored); n_kept: the (layer, rank)
    pairs kept (structured: each layer's count is how many of its ranks are among the n_kept best composite
    scores) or the (layer, kv-head, rank) triples kept (unstructured: each head's own count)."""
    L, H, T = scores.shape
    valid = valid_mask(lengths.reshape(-1), T).view(L, H, T)
    s = scores.float().masked_fill(~valid, float("-inf"))
    ranked = s.sort(dim=-1, descending=True).values  # [L, H, T] composite scores per head (invalid ranks last)
    if structured:
        if agg_head == "mean":
            cnt = valid.sum(1)  # [L, T] heads holding each rank (the ranks sort to the front like the slots)
            comp = ranked.masked_fill(~valid, 0.0).sum(1) / cnt.clamp(min=1)
            comp = comp.masked_fill(cnt == 0, float("-inf"))  # [L, T]
        else:
            comp = ranked.amax(1)
        comp[:, :keep_token_lower_bound] += 1e9
        comp[0] = comp.max(dim=0).values  # layer 0 ranks with the best layer (kvpress)
        n_kept = min(n_kept, int((comp > float("-inf")).sum()))
        per_layer = torch.bincount(comp.reshape(-1).topk(n_kept).indices // T, minlength=L)  # [L]
        counts = per_layer[:, None].expand(L, H)
    else:
        ranked[..., :keep_token_lower_bound] += 1e9
        n_kept = min(n_kept, int(valid.sum()))
        counts = torch.bincount(ranked.reshape(-1).topk(n_kept).indices // T, minlength=L * H).view(L, H)
    order = s.argsort(dim=-1, descending=True)  # [L, H, T]
    take = torch.arange(T, device=s.device)[None, None, :] < torch.minimum(counts, lengths)[..., None]
    kept = torch.zeros_like(valid)
    kept.scatter_(-1, order, take)
    return kept


@register_method("kvcompose")
@dataclass
class KVCompose(KVzip):
    """The prompt repeated as queries over itself; max attention per query head, composite (structured) or
    per-head counts over all layers."""
    supports_latent: ClassVar[bool] = False  # KVzip's scores are; KVCompose's are not checked on latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    structured: bool = True
    agg_task: str = "max"
    agg_group: str = "mean"
    agg_head: str = "mean"
    add_v_norm: bool = False
    add_mean_across_heads: bool = True
    keep_token_lower_bound: int = 0
    # KVzip's options that kvcompose does not have (the repeat is the prompt alone, in one pass per prefill chunk)
    layerwise: bool = field(default=False, init=False)
    n_sink: int = field(default=0, init=False)
    kvzip_plus_normalization: bool = field(default=False, init=False)
    chunk_size: int = field(default=1, init=False)
    prev_postfix_size: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool(self.name, "structured", self.structured)
        check_choice(self.name, "agg_task", self.agg_task, ("max",))
        check_choice(self.name, "agg_group", self.agg_group, AGGREGATES)
        check_choice(self.name, "agg_head", self.agg_head, AGGREGATES)
        check_bool(self.name, "add_v_norm", self.add_v_norm)
        check_bool(self.name, "add_mean_across_heads", self.add_mean_across_heads)
        check_int(self.name, "keep_token_lower_bound", self.keep_token_lower_bound, 0)

    def bind_engine(self, engine: Any) -> None:
        if len(engine.cache.method_layers) != engine.cache.num_layers:
            raise UserError("kvcompose repeats the prompt through every layer, and a sliding-window layer's ring would "
                            "lose its window to it: not supported for a model with sliding layers")
        if tp_size_of(getattr(self, "model_config", None)) > 1:
            raise UserError("kvcompose ranks every layer's and kv-head's scores together: not supported with "
                            "runtime.tensor_parallel (use one device)")
        self.engine = engine
        self.prefix_ids, self.suffix_ids = [], []  # no template prefix is set apart (kvpress scores the whole context)

    def _reconstruct_prompt(self, slot: int, ids: list[int], scored: int, start: int) -> None:
        """The tokens not yet scored run again after the sequence, as queries over it (kvpress: the context)."""
        if scored < len(ids):
            self._reconstruct(slot, ids[scored:], scored, len(ids), len(ids))

    def observe(self, obs: Observation) -> None:
        p, slot = self._pass, obs.slot
        if not self.reconstructing or p is None or p["slot"] != slot:
            return
        k_pos = obs.positions  # [H, T]
        s = repeat_attention_max(obs.step_queries, obs.step_query_positions, obs.keys, k_pos, obs.lengths,
                                 obs.head_dim ** -0.5, p["context_len"])  # [H, G, T]
        st = self.state(slot, obs.layer)
        n_ctx = int(((k_pos >= 0) & (k_pos < p["context_len"])).sum(-1).max())  # prompt slots come first
        old = st.get(SCORES)
        if old is None:
            old = torch.zeros(*s.shape[:2], 0, device=s.device)
        if old.shape[-1] < n_ctx:
            old = torch.nn.functional.pad(old, (0, n_ctx - old.shape[-1]))
        st[SCORES] = torch.maximum(old[..., :n_ctx], s[..., :n_ctx])

    def head_scores(self, slot: int, layer: int, held: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's kv-head scores [H, T] (compute_scores + enhance_scores) and lengths [H]; tokens kept
        uncompressed +inf."""
        cache = self.engine.cache
        lengths = cache.lengths[slot, layer]
        _, v, pos = cache.gather(layer, slot)  # [H, T, D], [H, T]
        H, T = pos.shape
        per_query_head = self.state(slot, layer).get(SCORES)  # [H, G, T'] (None: nothing repeated yet)
        if per_query_head is None:
            s = torch.zeros(H, T, device=pos.device)
        else:
            g = per_query_head.mean(1) if self.agg_group == "mean" else per_query_head.amax(1)
            s = torch.nn.functional.pad(g, (0, max(0, T - g.shape[-1])))[:, :T]
        if self.add_v_norm:
            s = s * v.float().norm(dim=-1)
        valid = valid_mask(lengths, T)
        if self.add_mean_across_heads:  # the mean over the kv-heads holding each position
            P = int(pos.max()) + 1 if valid.any() else 1
            idx = pos.clamp(min=0).to(torch.int64)
            total = torch.zeros(H, P, device=s.device).scatter_add_(1, idx, s.masked_fill(~valid, 0.0)).sum(0)
            count = torch.zeros(H, P, device=s.device).scatter_add_(1, idx, valid.float()).sum(0)
            s = s + (total / count.clamp(min=1))[idx]
        for a, b in held:
            s = s.masked_fill((pos >= a) & (pos < b), float("inf"))
        return s, lengths

    def _evict(self, slot: int, budget: int, held: list[tuple[int, int]]) -> None:
        """Keep layers x budget (layer, rank) pairs (unstructured: layers x kv_heads x budget) over all layers."""
        cache = self.engine.cache
        L, H = cache.num_layers, cache.num_kv_heads
        per_layer = [self.head_scores(slot, layer, held) for layer in range(L)]
        lengths = torch.stack([n for _, n in per_layer])  # [L, H]
        if int(lengths.sum()) <= L * H * budget:
            return
        T = max(s.shape[1] for s, _ in per_layer)
        s = torch.stack([torch.nn.functional.pad(x, (0, T - x.shape[1])) for x, _ in per_layer])  # [L, H, T]
        n_kept = L * budget if self.structured else L * H * budget
        kept = kvcompose_keep(s, lengths, n_kept, structured=self.structured, agg_head=self.agg_head,
                              keep_token_lower_bound=self.keep_token_lower_bound)  # [L, H, T]
        for layer in range(L):
            chosen = kept[layer]
            n = max(1, int(chosen.sum(-1).max()))
            order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)[:, :n]  # chosen slots in order
            self._keep(slot, layer, torch.where(chosen.gather(-1, order), order, torch.full_like(order, -1)))

    def _keep(self, slot: int, layer: int, keep: torch.Tensor) -> None:
        self.engine.cache.keep_tokens(layer, slot, keep)
        st = self.state(slot, layer)
        s = st.get(SCORES)  # [H, G, T']
        if s is not None:
            s = torch.nn.functional.pad(s, (0, max(0, int(keep.max()) + 1 - s.shape[-1])))
            idx = keep.clamp(min=0)[:, None, :].expand(-1, s.shape[1], -1)
            st[SCORES] = s.gather(-1, idx).masked_fill((keep < 0)[:, None, :], 0.0)
