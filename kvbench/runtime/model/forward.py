"""The Llama-family forward pass over the paged KV cache.

Covers Llama 2/3/3.x (llama3 rope scaling), Mistral, Qwen2/2.5 (qkv bias), Qwen3 (q/k RMSNorm),
SmolLM2 and tied embeddings. Weights are taken from a loaded transformers model; the forward is
our own so every token's K/V goes through the paged cache and the method hooks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.backends.cpu.threads import StepThreads
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.cache.kv_cache import AppendPlan, PagedKVCache
from kvbench.runtime.hooks import CacheHooks, LayerContext
from kvbench.runtime.model.rope import RotaryTable, apply_rotary

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Architecture facts the forward needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor  # [E]
    qkv: Linear  # E -> (Hq + 2H) * D, q/k/v fused (with Qwen2's bias)
    o: Linear  # Hq * D -> E
    ln_mlp: torch.Tensor  # [E]
    gate_up: Linear  # E -> 2I, gate and up fused
    down: Linear  # I -> E
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]


@dataclass
class RaggedGroup:
    """Sequences of one ragged step that take the same number of new tokens (all the step's decode tokens, or one
    prefill chunk): a rectangular [S, Q] slice of the step's flat token list, with its cache slots."""

    tokens: torch.Tensor  # [S, Q] int64
    plan: AppendPlan  # from cache.prepare_append(slots, positions [S, Q])
    phase: str = "prefill"  # "prefill" or "decode"
    last_chunk: bool = True  # the final chunk of a prompt (always True in decode)




def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale."""
    dtype = x.dtype
    if dtype == torch.float32:  # fused kernel, same math in fp32
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class LlamaFamilyModel:
    """Weights plus a forward over the paged cache."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: Linear, rotary: RotaryTable):
        self.config = config
        self.embed = embed  # [V, E]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # E -> V (a copy of embed when tied)
        self.rotary = rotary
        self.dtype = embed.dtype
        self.device = embed.device
        # fp32 on CPU: RMSNorm and RoPE through the C kernels (tests compare both paths), whatever the attention
        # backend
        self.use_cpu_kernels = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.available()
        self.step_threads = StepThreads() if self.device.type == "cpu" else None
        self.fuse_decode_layers = True  # the backend's fused decode step where it has one (backends/cpu)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (embedding row lookups excluded unless tied)."""
        n = self.lm_head.nbytes + self.final_norm.nbytes
        for lw in self.layers:
            for t in (lw.ln_attn, lw.qkv, lw.o, lw.ln_mlp, lw.gate_up, lw.down, lw.q_norm, lw.k_norm):
                if t is not None:
                    n += t.nbytes
        return n

    def forward(self, tokens: torch.Tensor, cache: PagedKVCache, plan: AppendPlan, *,
                backend: AttentionBackend = TORCH, hook: CacheHooks | None = None,
                phase: str = "prefill", last_chunk: bool = True, logits_for: str = "last",
                rope_mode: str = "original") -> torch.Tensor | None:
        """One rectangular step: tokens [S, Q] of S sequences, Q new tokens each (their cache slots in `plan`).
        Returns logits [S, V] ("last"), [S, Q, V] ("all") or None. rope_mode "original" | "cache" (positions
        re-indexed inside the cache)."""
        group = RaggedGroup(tokens, plan, phase, last_chunk)
        return self.forward_ragged([group], cache, backend=backend, hook=hook, logits_for=logits_for,
                                   rope_mode=rope_mode)[0]

    def forward_ragged(self, groups: list[RaggedGroup], cache: PagedKVCache, *,
                       backend: AttentionBackend = TORCH, hook: CacheHooks | None = None,
                       logits_for: str = "last", rope_mode: str = "original") -> list[torch.Tensor | None]:
        """One ragged step over the flat list of every group's tokens (vLLM v1's batch: prefill chunks and decode
        tokens of many sequences, each with its own length, positions and cache slots). Per group: logits
        [S_g, V] ("last"), [S_g, Q_g, V] ("all") or None. On CPU a decode-sized step runs with the thread count
        that `StepThreads` finds fastest (1 or all: it differs on a machine shared with other processes)."""
        st = self.step_threads
        if st is None or torch.is_grad_enabled():
            return self._forward(groups, cache, backend, hook, logits_for, rope_mode)
        st.begin(sum(g.tokens.numel() for g in groups))
        try:
            return self._forward(groups, cache, backend, hook, logits_for, rope_mode)
        finally:
            st.end()

    def _forward(self, groups: list[RaggedGroup], cache: PagedKVCache, backend: AttentionBackend,
                 hook: CacheHooks | None, logits_for: str, rope_mode: str) -> list[torch.Tensor | None]:
        """The dense ops (norms, projections, RoPE, MLP, head) run once over the flat token list x [N, E]; the
        attention (cache write, paged attention, the method's hook) runs per group, so a hook sees exactly the
        rectangular [S_g, Hq, Q_g, D] inputs of a step of that group alone. A single group may run fused instead
        (the backend's `fused_decode`: whole layers per kernel call)."""
        cfg = self.config
        Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        pre_rope = cache.store_pre_rope
        need_scores = bool(hook is not None and hook.needs_key_scores)
        fast = self.use_cpu_kernels and not torch.is_grad_enabled()  # the C kernels have no backward
        norm = cpu_kernels.rms_norm if fast else rms_norm
        sizes = [g.tokens.numel() for g in groups]
        offsets = [sum(sizes[:i]) for i in range(len(groups))]
        N = sum(sizes)
        qpos = torch.cat([g.plan.query_positions.reshape(-1) for g in groups])  # [N]
        known = [getattr(g.plan, "max_position", None) for g in groups]
        cos, sin = self.rotary.lookup(qpos, None if None in known else max(known))  # [N, D]
        x = self.embed[torch.cat([g.tokens.reshape(-1) for g in groups])]  # [N, E]
        fused = None
        before = hook is not None and getattr(hook, "acts_before_attention", False)
        hidden = hook is not None and getattr(hook, "reads_hidden_states", False)  # ctx.hidden: no fused layers
        if fast and len(groups) == 1 and not (before and groups[0].phase == "prefill") and not hidden:
            g = groups[0]
            fused = backend.fused_decode(self, g.tokens, cache, g.plan, rope_mode, cos, sin, need_scores)
        if fused is not None:  # whole layers per C call, x updated in place
            g = groups[0]
            # a hook that reads only the cache in decode steps runs after the step, for each layer (one C call)
            after_step = (hook is not None and g.phase == "decode" and not need_scores
                          and not getattr(hook, "decode_reads_attention", True))
            after = None if hook is None or after_step else lambda li, q, key_scores: hook.after_attention(
                LayerContext(li, cache, g.plan, g.phase, g.last_chunk, q, key_scores, self.rotary))
            fused.run(x, after)
            if after_step:
                for li in range(cfg.num_layers):
                    hook.after_attention(LayerContext(li, cache, g.plan, g.phase, g.last_chunk, None, None,
                                                      self.rotary))
        # a pure decode step (one token per sequence) may take the C GEMV up to GEMV_MAX_ROWS rows (linear.Linear)
        gemv_rows = cpu_kernels.GEMV_MAX_ROWS if (len(groups) == 1 and groups[0].phase == "decode"
                                                  and groups[0].tokens.shape[1] == 1) else None
        for li, lw in enumerate(self.layers if fused is None else ()):
            h = norm(x, lw.ln_attn, eps)
            qkv = lw.qkv(h, gemv_rows)  # [N, (Hq + 2H) D]
            q, k, v = qkv.split([Hq * D, H * D, H * D], dim=-1)
            q, k, v = q.view(N, Hq, D), k.view(N, H, D), v.view(N, H, D)  # views of qkv
            rotated = not pre_rope and not cfg.qk_norm  # q and k rotated here, once for every group
            if rotated and fast:  # in place in qkv (q and k are views)
                cpu_kernels.rotary_(qkv, Hq + H, D, cos, sin)
            elif rotated:  # q and k together: one pass
                qk = apply_rotary(qkv[:, : (Hq + H) * D].view(N, Hq + H, D), cos[:, None], sin[:, None])
                q, k = qk[:, :Hq], qk[:, Hq:]
            out = torch.empty(N, Hq * D, dtype=x.dtype, device=x.device)  # attention output
            for g, off, n in zip(groups, offsets, sizes):
                S, Q = g.tokens.shape
                rows = slice(off, off + n)
                o = self._attend_group(li, lw, g, q[rows], k[rows], v[rows], cos[rows].view(S, Q, D),
                                       sin[rows].view(S, Q, D), rotated, cache, backend, hook, need_scores,
                                       rope_mode, h[rows].view(S, Q, -1) if hidden else None)  # [S, Hq, Q, D]
                out[rows] = o.transpose(1, 2).reshape(n, Hq * D)
            x = x + lw.o(out, gemv_rows)
            h = norm(x, lw.ln_mlp, eps)
            gate, up = lw.gate_up(h, gemv_rows).chunk(2, dim=-1)
            x = x + lw.down(F.silu(gate) * up, gemv_rows)
        if logits_for == "none":
            return [None] * len(groups)
        if logits_for == "last":  # the last token of every sequence
            last = [off + (i + 1) * g.tokens.shape[1] - 1 for g, off in zip(groups, offsets)
                    for i in range(g.tokens.shape[0])]
            x = x[torch.tensor(last, dtype=torch.int64, device=x.device)] if N != len(last) else x
        # a pure decode step's head takes the C GEMV too, as its layers do (faster than oneDNN at up to 16 rows, with
        # the next weight tile prefetched: csrc/decode_ops.h, prefetch_share_l2; figures in docs/benchmark-results.md)
        logits = self.lm_head(norm(x.contiguous(), self.final_norm, eps), gemv_rows)  # [rows, V]
        if logits_for == "last":
            return list(logits.split([g.tokens.shape[0] for g in groups]))
        return [part.view(*g.tokens.shape, -1) for g, part in zip(groups, logits.split(sizes))]

    def _attend_group(self, li: int, lw: LayerWeights, g: RaggedGroup, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: bool, cache: PagedKVCache,
                      backend: AttentionBackend, hook: CacheHooks | None, need_scores: bool,
                      rope_mode: str, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One group's attention of layer li: its rows of q [n, Hq, D], k, v [n, H, D] (n = S*Q; RoPE already
        applied when `rotated`), cos / sin [S, Q, D], hidden [S, Q, E] the attention input for a hook that reads it;
        writes its K/V, attends, calls the hook; returns out [S, Hq, Q, D]."""
        cfg = self.config
        Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = Hq // H
        S, Q = g.tokens.shape
        plan = g.plan
        q = q.reshape(S, Q, Hq, D).transpose(1, 2)  # [S, Hq, Q, D]
        k = k.reshape(S, Q, H, D).transpose(1, 2)  # [S, H, Q, D]
        v = v.reshape(S, Q, H, D).transpose(1, 2)
        if cfg.qk_norm:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        cos_q, sin_q = cos[:, None], sin[:, None]  # [S, 1, Q, D]
        rotate_keys = None
        if rotated:
            pass
        elif not cache.store_pre_rope:  # after q/k norm (Qwen3)
            q = apply_rotary(q, cos_q, sin_q)
            k = apply_rotary(k, cos_q, sin_q)
        elif rope_mode == "original":
            q = apply_rotary(q, cos_q, sin_q)
            rotate_keys = self._rotate_at
        else:  # re-indexed: query at its slot in the cache, keys at their slot index
            lens = plan.lengths[:, li]  # [S, H]
            qslot = lens.unsqueeze(-1) - Q + torch.arange(Q, device=lens.device)  # [S, H, Q]
            cq, sq = self.rotary.lookup(qslot, plan.tables.shape[-1] * cache.block_size - 1)  # [S, H, Q, D]
            q = apply_rotary(q.reshape(S, H, G, Q, D), cq[:, :, None], sq[:, :, None]).view(S, Hq, Q, D)
            rotate_keys = self._rotate_at_slot
        cache.write(li, plan, k, v)
        if hook is not None and g.phase == "prefill" and getattr(hook, "acts_before_attention", False):
            # the method cuts the layer's K/V before its attention: the chunk attends to what it keeps
            hook.before_attention(LayerContext(li, cache, plan, g.phase, g.last_chunk, q, None, self.rotary))
            cache.refresh_plan_layer(plan, li)
        out, key_scores = cache.attend(
            li, q, plan, cfg.head_dim ** -0.5, backend=backend, return_key_scores=need_scores,
            rotate_keys=rotate_keys, causal=Q > 1,
        )
        if hook is not None:
            hook.after_attention(LayerContext(li, cache, plan, g.phase, g.last_chunk, q, key_scores, self.rotary,
                                              hidden))
        return out

    def _rotate_at(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k [S, H, T, D] stored before RoPE, rotated at the keys' original positions [S, H, T] (none past the
        step's queries, whose lookup already sized the table: no device read)."""
        cos, sin = self.rotary.lookup(positions, self.rotary.cos.shape[0] - 1)
        return apply_rotary(k, cos, sin)

    def _rotate_at_slot(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """k [S, H, T, D] stored before RoPE, rotated at slot index 0..T-1 (StreamingLLM re-indexing)."""
        T = k.shape[2]
        cos, sin = self.rotary.lookup(torch.arange(T, device=k.device), T - 1)
        return apply_rotary(k, cos, sin)


def build_from_transformers(hf_model: Any, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> LlamaFamilyModel:
    """Copy the weights of a transformers Llama-family causal LM into a LlamaFamilyModel."""
    hc = hf_model.config
    mt = getattr(hc, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    num_heads = hc.num_attention_heads
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // num_heads
    qkv_bias = mt == "qwen2" or bool(getattr(hc, "attention_bias", False))
    cfg = ModelConfig(
        model_type=mt,
        vocab_size=hc.vocab_size,
        hidden_size=hc.hidden_size,
        num_layers=hc.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hc, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        intermediate_size=hc.intermediate_size,
        rms_norm_eps=hc.rms_norm_eps,
        qkv_bias=qkv_bias,
        qk_norm=mt == "qwen3",
        tie_word_embeddings=bool(getattr(hc, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(hc, "max_position_embeddings", 4096),
    )
    sd = hf_model.state_dict()
    ref = sd["model.embed_tokens.weight"]
    dtype = dtype or ref.dtype
    device = torch.device(device) if device is not None else ref.device

    def t(name: str) -> torch.Tensor:
        return sd[name].to(device=device, dtype=dtype).contiguous()

    def linear(*names: str, bias: torch.Tensor | None = None) -> Linear:  # [out, in] weights concatenated
        return Linear(torch.cat([t(n) for n in names]), bias)

    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        b_qkv = None
        if cfg.qkv_bias and (p + "self_attn.q_proj.bias") in sd:
            b_qkv = torch.cat([t(p + "self_attn.q_proj.bias"), t(p + "self_attn.k_proj.bias"), t(p + "self_attn.v_proj.bias")])
        layers.append(LayerWeights(
            ln_attn=t(p + "input_layernorm.weight"),
            qkv=linear(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight",
                       bias=b_qkv),
            o=linear(p + "self_attn.o_proj.weight"),
            ln_mlp=t(p + "post_attention_layernorm.weight"),
            gate_up=linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=linear(p + "mlp.down_proj.weight"),
            q_norm=t(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=t(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
        ))
    embed = t("model.embed_tokens.weight")
    if cfg.tie_word_embeddings or "lm_head.weight" not in sd:
        lm_head = Linear(embed)
    else:
        lm_head = linear("lm_head.weight")
    rot = hf_model.model.rotary_emb
    rotary = RotaryTable(rot.inv_freq.to(device), getattr(rot, "attention_scaling", 1.0), dtype,
                         max_positions=min(cfg.max_position_embeddings, 8192))
    return LlamaFamilyModel(cfg, embed, layers, t("model.norm.weight"), lm_head, rotary)
