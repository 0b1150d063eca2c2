"""Tensor parallelism, Megatron-style: one Llama-family model sharded by attention head over a torch.distributed
group, and its paged KV pool sharded by kv-head with it.

    shard = shard_model(model, tp_rank, tp_size, group)   # a LlamaFamilyModel holding this rank's heads only
    engine = Engine(shard, method, ...)                    # the pool and block tables hold this rank's kv-heads

Per layer (rank r of n):
- q/k/v (fused qkv) and gate/up: column-parallel. The rank keeps query heads r*Hq/n .. and the kv-heads
  r*H/n .. they read (GQA groups stay whole: query head i reads kv-head i // (Hq/H)), and intermediate
  columns r*I/n ..; no communication.
- o_proj and down_proj: row-parallel over those same features; one all-reduce (sum) of each output
  (`RowParallelLinear`), so every rank holds the whole residual stream after each.
- Embedding, the norms and lm_head stay replicated (every rank computes the same logits).
The model's config becomes a `ShardedModelConfig`: num_heads, num_kv_heads and intermediate_size are the
rank's, so the engine builds a cache of num_kv_heads // n heads (each rank's pool holds its heads' blocks only)
and methods see the rank's heads. A method whose scores are per kv-head works unchanged; one that ranks tokens
across kv-heads gathers its scores first (`gather_kv_heads`, one all-gather per eviction).

The fused CPU decode step (whole layers per C call) has no all-reduce inside: a shard runs layer by layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.model.forward import LayerWeights, LlamaFamilyModel, ModelConfig


@dataclass
class ShardedModelConfig(ModelConfig):
    """A ModelConfig whose head and MLP sizes are one tensor-parallel rank's (the full sizes kept beside them)."""

    tp_rank: int = 0
    tp_size: int = 1
    full_num_heads: int = 0
    full_num_kv_heads: int = 0
    tp_group: Any = field(default=None, repr=False, compare=False)  # torch.distributed ProcessGroup


def tp_size_of(model_config: Any) -> int:
    """The tensor-parallel size a model config belongs to (1 for an unsharded model)."""
    return int(getattr(model_config, "tp_size", 1) or 1)


class RowParallelLinear:
    """y = all_reduce(x_shard @ W_shard^T) + b: the rank's input features of a row-parallel projection (o_proj,
    down_proj), summed over the tensor-parallel group (one all-reduce per call)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], group: Any):
        self.local = Linear(weight)  # [out, in / n]
        self.bias = bias  # added once, after the sum
        self.group = group
        self.out_features, self.in_features = self.local.out_features, self.local.in_features
        self.dtype, self.device = self.local.dtype, self.local.device
        self.nbytes = self.local.nbytes + (bias.nbytes if bias is not None else 0)

    @property
    def backend(self) -> str:
        return self.local.backend

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight [out, in / n] (criticalkv reads o_proj's columns of its heads)."""
        return self.local.dense_weight()

    def __call__(self, x: torch.Tensor, gemv_rows: int | None = None) -> torch.Tensor:
        import torch.distributed as dist

        y = self.local(x, gemv_rows).contiguous()  # [..., out], this rank's partial sum
        dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y


def check_shardable(num_heads: int, num_kv_heads: int, intermediate_size: int, tp_size: int) -> Optional[str]:
    """Why a model of these sizes cannot be sharded over tp_size ranks, or None."""
    if num_kv_heads % tp_size:
        return f"its {num_kv_heads} kv-heads are not divisible by {tp_size}"
    if num_heads % tp_size:
        return f"its {num_heads} attention heads are not divisible by {tp_size}"
    if intermediate_size % tp_size:
        return f"its MLP width {intermediate_size} is not divisible by {tp_size}"
    return None


def shard_model(model: LlamaFamilyModel, tp_rank: int, tp_size: int, group: Any,
                device: str | torch.device | None = None) -> LlamaFamilyModel:
    """This rank's shard of `model` (column-parallel qkv and gate_up, row-parallel o and down), on `device` (default
    the model's). The full model is read, not changed; ValueError when the sizes do not divide (check_shardable)."""
    cfg = model.config
    if not cfg.plain:
        raise ValueError(f"cannot shard the model over {tp_size} ranks: model_type {cfg.model_type!r} has per-layer "
                         f"attention variants or a non-Llama layer; tensor parallelism runs Llama-family models only")
    why = check_shardable(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp_size)
    if why is not None:
        raise ValueError(f"cannot shard the model over {tp_size} ranks: {why}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in 0..{tp_size - 1}")
    device = torch.device(device) if device is not None else model.device
    D, n, r = cfg.head_dim, tp_size, tp_rank
    hq, h, inter = cfg.num_heads // n, cfg.num_kv_heads // n, cfg.intermediate_size // n
    q_rows = slice(r * hq * D, (r + 1) * hq * D)
    k_rows = slice(cfg.num_heads * D + r * h * D, cfg.num_heads * D + (r + 1) * h * D)
    v_rows = slice((cfg.num_heads + cfg.num_kv_heads) * D + r * h * D,
                   (cfg.num_heads + cfg.num_kv_heads) * D + (r + 1) * h * D)
    i_rows = slice(r * inter, (r + 1) * inter)
    up_rows = slice(cfg.intermediate_size + r * inter, cfg.intermediate_size + (r + 1) * inter)

    def on(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(device).contiguous()

    layers = []
    for lw in model.layers:
        qkv = lw.qkv.dense_weight()  # [(Hq + 2H) D, E]
        qkv_bias = None if lw.qkv.bias is None else torch.cat(
            [lw.qkv.bias[q_rows], lw.qkv.bias[k_rows], lw.qkv.bias[v_rows]])
        gate_up = lw.gate_up.dense_weight()  # [2I, E]
        layers.append(LayerWeights(
            ln_attn=on(lw.ln_attn),
            qkv=Linear(on(torch.cat([qkv[q_rows], qkv[k_rows], qkv[v_rows]])), on(qkv_bias)),
            o=RowParallelLinear(on(lw.o.dense_weight()[:, q_rows]), on(lw.o.bias), group),
            ln_mlp=on(lw.ln_mlp),
            gate_up=Linear(on(torch.cat([gate_up[i_rows], gate_up[up_rows]])), on(lw.gate_up.bias)),
            down=RowParallelLinear(on(lw.down.dense_weight()[:, i_rows]), on(lw.down.bias), group),
            q_norm=on(lw.q_norm),
            k_norm=on(lw.k_norm),
        ))
    shard_cfg = ShardedModelConfig(
        **{f.name: getattr(cfg, f.name) for f in fields(ModelConfig)},
        tp_rank=r, tp_size=n, full_num_heads=cfg.num_heads, full_num_kv_heads=cfg.num_kv_heads, tp_group=group)
    shard_cfg.num_heads, shard_cfg.num_kv_heads, shard_cfg.intermediate_size = hq, h, inter
    lm_head = model.lm_head if device == model.device else Linear(on(model.lm_head.dense_weight()),
                                                                  on(model.lm_head.bias))
    rotary = model.rotary
    if device != model.device:
        rotary = type(rotary)(rotary.inv_freq.to(device), rotary.scaling, model.dtype,
                              max_positions=rotary.cos.shape[0])
    out = LlamaFamilyModel(shard_cfg, on(model.embed), layers, on(model.final_norm), lm_head, rotary)
    out.fuse_decode_layers = False  # the fused C decode step runs whole layers: no all-reduce between them
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        out.tokenizer = tok
    return out


def gather_kv_heads(x: torch.Tensor, model_config: Any, *, dim: int = 0, length: Optional[int] = None) -> torch.Tensor:
    """Every rank's kv-heads of x along `dim` (rank order = head order), for a method that ranks tokens across
    kv-heads: one all-gather over the tensor-parallel group; x itself for an unsharded model. The last dim (tokens)
    may differ between ranks (heads that kept different counts): it is padded with 0 to `length` first (a length
    every rank knows, such as the tokens the sequence has seen), so shapes agree."""
    n = tp_size_of(model_config)
    if n == 1:
        return x
    import torch.distributed as dist

    if length is not None and x.shape[-1] < length:
        x = torch.nn.functional.pad(x, (0, length - x.shape[-1]))
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=model_config.tp_group)
    return torch.cat(parts, dim=dim)


def local_kv_heads(x: torch.Tensor, model_config: Any, *, dim: int = 0) -> torch.Tensor:
    """This rank's slice along `dim` of a tensor over every kv-head (the inverse of gather_kv_heads)."""
    n = tp_size_of(model_config)
    if n == 1:
        return x
    h = model_config.num_kv_heads
    return x.narrow(dim, model_config.tp_rank * h, h)


def gather_head_scores(scores: torch.Tensor, lengths: torch.Tensor, model_config: Any,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [..., H, T] and table lengths [..., H] of this rank's kv-heads -> those of every kv-head,
    [..., H_all, width] (padded with 0 past T) and [..., H_all], in ONE all-gather: the lengths travel as the first
    column of the scores (exact in fp32 below 2**24 tokens). `width` must be the same on every rank and at least
    every rank's T (the tokens the sequence has seen: tables only shrink by eviction)."""
    n = tp_size_of(model_config)
    if n == 1:
        return scores, lengths
    s = scores.float()
    if s.shape[-1] < width:
        s = torch.nn.functional.pad(s, (0, width - s.shape[-1]))
    packed = torch.cat([lengths.to(s.dtype).unsqueeze(-1), s], dim=-1)  # [..., H, 1 + width]
    every = gather_kv_heads(packed, model_config, dim=packed.dim() - 2)
    return every[..., 1:], every[..., 0].to(torch.int64)


def local_keep(keep: torch.Tensor, model_config: Any) -> torch.Tensor:
    """This rank's rows of a keep set [H_all, n] (sorted slots, -1 pads) chosen over every kv-head, trimmed to the
    most slots one of its heads keeps (at least one column)."""
    if tp_size_of(model_config) == 1:
        return keep
    mine = local_kv_heads(keep, model_config, dim=0)
    return mine[:, : max(1, int((mine >= 0).sum(-1).max()))]


def sum_over_ranks(value: int, model_config: Any, device: Any = None, op: str = "sum") -> int:
    """An integer summed (op "min", "max": reduced) over the tensor-parallel group (one all-reduce): a decision
    every rank must take alike from all kv-heads' figures (whether a layer's tables together exceed their budget,
    whether every rank's pool has room)."""
    if tp_size_of(model_config) == 1:
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op],
                    group=model_config.tp_group)
    return int(t.item())


class RankAgreedCache:
    """A tensor-parallel rank's cache as its scheduler sees it: the block counts behind admission, preemption and
    swapping agreed over the group, so every rank schedules the same step. Each rank's pool holds its kv-heads'
    blocks, and a method whose kept tokens differ between kv-heads (adakv, kvzip) fills the ranks' pools unevenly:
    free and capacity are the least over the ranks, blocks needed or held the most (one all-reduce each), so
    whatever fits by these counts fits in every rank's pool. Everything else is the rank's own cache."""

    def __init__(self, cache: Any, model_config: Any):
        self._cache, self._config = cache, model_config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def _agreed(self, value: int, op: str) -> int:
        return sum_over_ranks(value, self._config, self._cache.device, op)

    def free_blocks(self) -> int:
        return self._agreed(self._cache.free_blocks(), "min")

    def capacity_blocks(self) -> int:
        return self._agreed(self._cache.capacity_blocks(), "min")

    def blocks_for_append(self, slots: list, n_tokens: int) -> int:
        return self._agreed(self._cache.blocks_for_append(slots, n_tokens), "max")

    def blocks_held(self, slot: int) -> int:
        return self._agreed(self._cache.blocks_held(slot), "max")

    def blocks_in_use_now(self) -> int:
        return self._agreed(self._cache.blocks_in_use_now(), "max")


def rank_agreed(cache: Any, model_config: Any) -> Any:
    """`cache` for a scheduler: itself on one rank, a RankAgreedCache on a tensor-parallel shard."""
    return RankAgreedCache(cache, model_config) if tp_size_of(model_config) > 1 else cache


def full_kv_heads(model_config: Any) -> int:
    """The model's kv-heads over every rank (num_kv_heads for an unsharded model)."""
    return int(getattr(model_config, "full_num_kv_heads", 0) or model_config.num_kv_heads)
