"""The decoder forward pass over the paged KV cache.

Covers Llama 2/3/3.x (llama3 rope scaling), Mistral (its sliding window honoured), Qwen2/2.5 (qkv bias), Qwen3 (q/k
RMSNorm), SmolLM2 and tied embeddings, Phi-3 / Phi-4-mini (fused qkv and gate_up, partial rotary), and Gemma 2 / 3
(local/global layers with their own RoPE bases, QK-norm, sandwich norms, embedding scale, query_pre_attn_scalar,
soft-capping), GPT-OSS (sinks, experts) and DeepSeek-V2 (multi-head latent attention: runtime.model.mla). Weights are
taken from a loaded transformers model (kvbench.runtime.model.families); the forward is
our own so every token's K/V goes through the paged cache and the method hooks. Per-layer attention types (full or
sliding(window), sinks, soft-capping): kvbench.runtime.model.attention_types.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvbench.runtime.backends.base import AttentionBackend, DecodeWeights
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.backends.cpu.threads import StepThreads
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.cache.kv_cache import AppendPlan, PagedKVCache
from kvbench.runtime.cache.kv_geometry import blocks_for_tokens
from kvbench.runtime.hooks import CacheHooks
from kvbench.runtime.model.attention_types import LayerAttention, VariantBackend
from kvbench.runtime.model.mla import absorb as mla_absorb
from kvbench.runtime.model.mla import attend_expanded as mla_attend_expanded
from kvbench.runtime.model.mla import expand_out as mla_expand_out
from kvbench.runtime.model.mla import project as mla_project
from kvbench.runtime.model.rope import RotaryTable, apply_rotary
from kvbench.runtime.model.step_hooks import StepHooks, no_hooks

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3", "gpt_oss",
                         "deepseek_v2")


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
    # "llama": pre-norm layers, RMSNorm x.to(dtype) * w; "gemma": sandwich norms (post-attention and post-MLP norms
    # too), RMSNorm (x * w).to(dtype) over weights stored as 1 + w, embeddings scaled by embed_scale; "gpt_oss":
    # pre-norm layers, RMSNorm (x * w).to(dtype), a mixture-of-experts MLP
    family: str = "llama"
    layer_attention: tuple = ()  # LayerAttention per layer (empty: every layer full, plain attention)
    attn_scale: float | None = None  # softmax scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c) (Gemma 2)
    embed_scale: float | None = None  # embeddings x this (Gemma: sqrt(hidden_size), in the model dtype)
    mlp_act: str = "silu"  # "silu" | "gelu_tanh"
    rotary_dim: int | None = None  # RoPE on the first rotary_dim dims of each head (None: all; Phi partial rotary)
    # multi-head latent attention (DeepSeek-V2/V3): the cache holds one row of kv_lora_rank + rope dims per token
    # (num_kv_heads 1, head_dim = that row's width, values inside it); runtime.model.mla
    mla: Any = None

    def attention(self, layer: int) -> LayerAttention:
        """Layer `layer`'s attention type (full and plain when the config lists none)."""
        return self.layer_attention[layer] if self.layer_attention else _FULL

    @property
    def layer_windows(self) -> tuple:
        """The window of each layer (None: full attention)."""
        return tuple(self.attention(i).window for i in range(self.num_layers))

    @property
    def plain(self) -> bool:
        """A Llama-shaped model whose every layer is plain attention: the fused CPU decode step, CUDA graphs and
        tensor parallelism apply (the others run the op-by-op torch path)."""
        return (self.family == "llama" and self.mla is None and all(a.plain for a in self.layer_attention)
                and self.mlp_act == "silu"
                and self.rotary_dim in (None, self.head_dim) and self.embed_scale is None
                and self.final_softcap is None)


_FULL = LayerAttention()


@dataclass
class LayerWeights:
    ln_attn: torch.Tensor  # [E]
    qkv: Linear | None  # E -> (Hq + 2H) * D, q/k/v fused (with Qwen2's bias); None with MLA
    o: Linear  # Hq * D -> E
    ln_mlp: torch.Tensor  # [E]
    gate_up: Linear | None  # E -> 2I, gate and up fused (None: a MoE MLP, `moe`)
    down: Linear | None  # I -> E
    q_norm: torch.Tensor | None = None  # [D]
    k_norm: torch.Tensor | None = None  # [D]
    post_attn_norm: torch.Tensor | None = None  # [E] sandwich norm of the attention output (Gemma)
    post_mlp_norm: torch.Tensor | None = None  # [E] sandwich norm of the MLP output (Gemma)
    sinks: torch.Tensor | None = None  # [Hq] learned sink logits (GPT-OSS)
    moe: Any = None  # a mixture-of-experts MLP h [N, E] -> [N, E] in place of gate_up / down (runtime.model.moe)
    mla: Any = None  # MLA's projections (runtime.model.mla.MLAWeights); qkv is then None


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


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Gemma RMSNorm over weight = 1 + w (stored so at load): scaled in fp32, then cast back."""
    dtype = x.dtype
    if dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(dtype)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft-capping), or x when cap is None."""
    return x if cap is None else torch.tanh(x / cap) * cap


class LlamaFamilyModel:
    """Weights plus a forward over the paged cache."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights], final_norm: torch.Tensor,
                 lm_head: Linear, rotary: RotaryTable, rotary_local: RotaryTable | None = None):
        self.config = config
        self.embed = embed  # [V, E]
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head  # E -> V (a copy of embed when tied)
        self.rotary = rotary  # the full layers' RoPE (what methods see: they act on full layers)
        self.rotary_local = rotary_local  # the sliding layers' RoPE where it differs (Gemma 3's local base)
        # Gemma and GPT-OSS scale in fp32 before the cast back (Llama: after it)
        self._norm = gemma_rms_norm if config.family in ("gemma", "gpt_oss") else rms_norm
        # the attention backend of each layer with a variant (window, sinks, soft-capping): the torch reference
        self._variant_backends = {li: VariantBackend(a.window, a.softcap, layers[li].sinks)
                                  for li, a in enumerate(config.layer_attention) if not a.plain}
        if config.mla is not None:  # keys wider than values: the torch reference (the kernels take one width)
            self._variant_backends.update({li: TORCH for li in range(config.num_layers)})
        # MLA's multi-token steps: "expanded" (per-head K/V from the cached latents) or "absorbed" (as decode; kept to
        # compare the two forms); mla_expanded_steps counts the (layer, group) attentions taken in the expanded form
        self.mla_prefill_form = "expanded"
        self.mla_expanded_steps = 0
        self.dtype = embed.dtype
        self.device = embed.device
        # fp32 on CPU: RMSNorm and RoPE through the C kernels (tests compare both paths), whatever the attention
        # backend
        self.use_cpu_kernels = self.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.available()
        self.step_threads = StepThreads() if self.device.type == "cpu" else None
        # the backend's fused decode step where it has one (backends/cpu): Llama-shaped models with plain attention
        self.fuse_decode_layers = config.plain

    def decode_weights(self) -> DecodeWeights:
        """The fused decode step's view of this model (kvbench.runtime.backends.base.DecodeWeights): its
        dimensions and layers, built once; `fuse` follows fuse_decode_layers at each call."""
        view = self.__dict__.get("_decode_weights")
        if view is None:
            cfg = self.config
            view = self._decode_weights = DecodeWeights(
                cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                cfg.rms_norm_eps, self.layers)
        view.fuse = self.fuse_decode_layers and self.use_cpu_kernels and not self.config.qk_norm
        return view

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (embedding row lookups excluded unless tied)."""
        n = self.lm_head.nbytes + self.final_norm.nbytes
        for lw in self.layers:
            for t in (lw.ln_attn, lw.qkv, lw.o, lw.ln_mlp, lw.gate_up, lw.down, lw.q_norm, lw.k_norm,
                      lw.post_attn_norm, lw.post_mlp_norm, lw.sinks, lw.moe, lw.mla):
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
        hooks = StepHooks.of(hook, cache, self.rotary)
        fast = self.use_cpu_kernels and not torch.is_grad_enabled()  # the C kernels have no backward
        x, rows = self._embed(groups)  # [N, E]
        count_decode_reads(groups, cache, self.config.num_layers)
        fused = self._fused_step(groups, cache, backend, hooks, rope_mode, rows) if fast else None
        if fused is not None:  # whole layers per C call, x updated in place
            fused.run(x, hooks.per_layer(groups[0]))
            fused.count_reads(cache.decode_reads)  # its retrieving layers' selections
            hooks.after_step(groups[0], self.config.num_layers)
        else:
            x = self._layers(x, groups, cache, backend, hooks, rope_mode, rows, fast)
        return self._logits(x, groups, logits_for, fast)

    def _embed(self, groups: list[RaggedGroup]) -> tuple[torch.Tensor, "StepRows"]:
        """The step's flat token list embedded, x [N, E], and its rows' RoPE and offsets."""
        cfg = self.config
        sizes = [g.tokens.numel() for g in groups]
        qpos = torch.cat([g.plan.query_positions.reshape(-1) for g in groups])  # [N]
        known = [getattr(g.plan, "max_position", None) for g in groups]  # a calibration's plan has none
        max_pos = None if None in known else max(known)
        cos, sin = self.rotary.lookup(qpos, max_pos)  # [N, Dr] (Dr = rotary dims: D unless partial)
        local = self.rotary_local.lookup(qpos, max_pos) if self.rotary_local is not None else None
        x = self.embed[torch.cat([g.tokens.reshape(-1) for g in groups])]  # [N, E]
        if cfg.embed_scale is not None:  # Gemma: the scale in the model dtype, as transformers applies it
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        return x, StepRows(sizes, [sum(sizes[:i]) for i in range(len(groups))], cos, sin, local)

    def _fused_step(self, groups: list[RaggedGroup], cache: PagedKVCache, backend: AttentionBackend,
                    hooks: StepHooks, rope_mode: str, rows: "StepRows") -> Any:
        """The backend's fused decode step for this step (whole layers per kernel call), or None: op by op. Only a
        single group whose hooks allow it (StepHooks.fusable) is tried; the backend says whether it can."""
        if not backend.fuses_decode or not hooks.fusable(groups) or groups[0].tokens.shape[1] != 1:
            return None
        g = groups[0]
        return backend.fused_decode(self.decode_weights(), g.tokens, cache.decode_pools(), g.plan, rope_mode, rows.cos,
                                    rows.sin, hooks.need_scores, retrieval=_retrieval(cache))

    def _layers(self, x: torch.Tensor, groups: list[RaggedGroup], cache: PagedKVCache, backend: AttentionBackend,
                hooks: StepHooks, rope_mode: str, rows: "StepRows", fast: bool) -> torch.Tensor:
        """Every layer op by op over x [N, E]; returns the new x."""
        cfg = self.config
        Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        N, Dr = x.shape[0], rows.cos.shape[-1]
        norm = cpu_kernels.rms_norm if fast else self._norm  # fp32: the same math for both norm styles
        gemv_rows = _gemv_rows(groups)
        unseen = no_hooks(cache, self.rotary)  # what a sliding layer's attention calls: no hook
        for li, lw in enumerate(self.layers):
            la = cfg.attention(li)
            lcos, lsin = rows.local if (rows.local is not None and la.window is not None) else (rows.cos, rows.sin)
            h = norm(x, lw.ln_attn, eps)
            if lw.mla is not None:
                out = self._mla_attention(li, lw, h, groups, rows.offsets, rows.sizes, lcos, lsin, cache, hooks)
                x = x + lw.o(out, gemv_rows)
                x = x + self._mlp(lw, norm(x, lw.ln_mlp, eps), gemv_rows, norm, eps)
                continue
            qkv = lw.qkv(h, gemv_rows)  # [N, (Hq + 2H) D]
            q, k, v = qkv.split([Hq * D, H * D, H * D], dim=-1)
            q, k, v = q.view(N, Hq, D), k.view(N, H, D), v.view(N, H, D)  # views of qkv
            rotated = not cache.store_pre_rope and not cfg.qk_norm  # q and k rotated here, once for every group
            if rotated and fast and Dr == D:  # in place in qkv (q and k are views)
                cpu_kernels.rotary_(qkv, Hq + H, D, lcos, lsin)
            elif rotated:  # q and k together: one pass
                qk = rope(qkv[:, : (Hq + H) * D].view(N, Hq + H, D), lcos[:, None], lsin[:, None])
                q, k = qk[:, :Hq], qk[:, Hq:]
            out = torch.empty(N, Hq * D, dtype=x.dtype, device=x.device)  # attention output
            layer_backend = self._variant_backends.get(li, backend)
            layer_hooks = hooks if la.window is None else unseen  # methods act on full layers only
            for g, off, n in zip(groups, rows.offsets, rows.sizes):
                S, Q = g.tokens.shape
                r = slice(off, off + n)
                hidden = h[r].view(S, Q, -1) if layer_hooks.reads_hidden else None
                o = self._attend_group(li, lw, g, q[r], k[r], v[r], lcos[r].view(S, Q, Dr), lsin[r].view(S, Q, Dr),
                                       rotated, cache, layer_backend, layer_hooks, rope_mode, hidden)  # [S, Hq, Q, D]
                out[r] = o.transpose(1, 2).reshape(n, Hq * D)
            if la.window is not None:
                slide_windows(cache, li, groups, la.window)
            a = lw.o(out, gemv_rows)
            x = x + (a if lw.post_attn_norm is None else norm(a, lw.post_attn_norm, eps))
            x = x + self._mlp(lw, norm(x, lw.ln_mlp, eps), gemv_rows, norm, eps)
        return x

    def _logits(self, x: torch.Tensor, groups: list[RaggedGroup], logits_for: str,
                fast: bool) -> list[torch.Tensor | None]:
        """Per group: logits [S_g, V] ("last": each sequence's last token), [S_g, Q_g, V] ("all") or None."""
        if logits_for == "none":
            return [None] * len(groups)
        sizes = [g.tokens.numel() for g in groups]
        N = x.shape[0]
        if logits_for == "last":  # the last token of every sequence
            offsets = [sum(sizes[:i]) for i in range(len(groups))]
            last = [off + (i + 1) * g.tokens.shape[1] - 1 for g, off in zip(groups, offsets)
                    for i in range(g.tokens.shape[0])]
            x = x[torch.tensor(last, dtype=torch.int64, device=x.device)] if N != len(last) else x
        norm = cpu_kernels.rms_norm if fast else self._norm
        # a pure decode step's head takes the C GEMV too, as its layers do (faster than oneDNN at up to 16 rows, with
        # the next weight tile prefetched: csrc/decode_ops.h, prefetch_share_l2; figures in docs/benchmark-results.md)
        logits = softcap(self.lm_head(norm(x.contiguous(), self.final_norm, self.config.rms_norm_eps),
                                      _gemv_rows(groups)), self.config.final_softcap)  # [rows, V]
        if logits_for == "last":
            return list(logits.split([g.tokens.shape[0] for g in groups]))
        return [part.view(*g.tokens.shape, -1) for g, part in zip(groups, logits.split(sizes))]

    def _mlp(self, lw: LayerWeights, h: torch.Tensor, gemv_rows: int | None, norm: Any, eps: float) -> torch.Tensor:
        """The MLP of one layer on h [N, E] (already normed), its sandwich norm applied (Gemma)."""
        if lw.moe is not None:
            m = lw.moe(h)
        else:
            gate, up = lw.gate_up(h, gemv_rows).chunk(2, dim=-1)
            act = F.silu(gate) if self.config.mlp_act == "silu" else F.gelu(gate, approximate="tanh")
            m = lw.down(act * up, gemv_rows)
        return m if lw.post_mlp_norm is None else norm(m, lw.post_mlp_norm, eps)

    def _mla_attention(self, li: int, lw: LayerWeights, h: torch.Tensor, groups: list[RaggedGroup],
                       offsets: list[int], sizes: list[int], cos: torch.Tensor, sin: torch.Tensor,
                       cache: PagedKVCache, hooks: StepHooks) -> torch.Tensor:
        """One MLA layer (runtime.model.mla) over h [N, E]: each token's latent row written to the cache; a group of
        one query per sequence (decode) attends in the absorbed form over the rows, a multi-token group (a prefill
        chunk) in the expanded form (per-head K/V from the cached latents; `mla_prefill_form` "absorbed" turns that
        off, for comparison). Hooks see the absorbed query, whose dot product with a row is the head's score.
        Returns [N, Hq * v]."""
        cfg = self.config
        Hq, D, r = cfg.num_heads, cfg.head_dim, cfg.mla.kv_lora_rank
        q_nope, q_pe, row = mla_project(cfg.mla, lw.mla, h, cos, sin, self._norm, cfg.rms_norm_eps, Hq)
        out = torch.empty(h.shape[0], Hq * cfg.mla.v_head_dim, dtype=h.dtype, device=h.device)
        for g, off, n in zip(groups, offsets, sizes):
            S, Q = g.tokens.shape
            rows = slice(off, off + n)
            expanded = Q > 1 and self.mla_prefill_form == "expanded"
            qn = q_nope[rows].reshape(S, Q, Hq, -1).transpose(1, 2)  # [S, Hq, Q, nope]
            qp = q_pe[rows].reshape(S, Q, Hq, -1).transpose(1, 2)  # [S, Hq, Q, rope]
            qg = mla_absorb(lw.mla, qn.transpose(1, 2), qp.transpose(1, 2)).transpose(1, 2) \
                if not expanded or hooks.active else None  # [S, Hq, Q, D]
            kg = row[rows].reshape(S, Q, 1, D).transpose(1, 2)  # [S, 1, Q, D]
            cache.write(li, g.plan, kg, kg[..., :r])
            hooks.before_attention(li, g, qg)
            if expanded:
                self.mla_expanded_steps += 1
                plan = g.plan
                rows_pool, tables = cache.latent_rows(li, plan)  # the pool in place, or a codec's decoded blocks
                o, key_scores = mla_attend_expanded(
                    cfg.mla, lw.mla, qn, qp, rows_pool, tables, plan.lengths[:, li],
                    plan.positions[:, li], plan.query_positions, cfg.attn_scale, return_key_scores=hooks.need_scores,
                )  # [S, Hq, Q, v]
                out[rows] = o.transpose(1, 2).reshape(n, -1)
            else:
                o, key_scores = cache.attend(li, qg, g.plan, cfg.attn_scale, backend=TORCH,
                                             return_key_scores=hooks.need_scores, causal=Q > 1)  # [S, Hq, Q, r]
                out[rows] = mla_expand_out(lw.mla, o.transpose(1, 2).reshape(n, Hq, r))
            hooks.after_attention(li, g, qg, key_scores)
        return out

    def _attend_group(self, li: int, lw: LayerWeights, g: RaggedGroup, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: bool, cache: PagedKVCache,
                      backend: AttentionBackend, hooks: StepHooks, rope_mode: str,
                      hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One group's attention of layer li: its rows of q [n, Hq, D], k, v [n, H, D] (n = S*Q; RoPE already
        applied when `rotated`), cos / sin [S, Q, D], hidden [S, Q, E] the attention input for a hook that reads it;
        writes its K/V, attends (over the method's retrieved blocks only where it retrieves), calls the hooks;
        returns out [S, Hq, Q, D]."""
        cfg = self.config
        Hq, H, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        G = Hq // H
        S, Q = g.tokens.shape
        plan = g.plan
        q = q.reshape(S, Q, Hq, D).transpose(1, 2)  # [S, Hq, Q, D]
        k = k.reshape(S, Q, H, D).transpose(1, 2)  # [S, H, Q, D]
        v = v.reshape(S, Q, H, D).transpose(1, 2)
        if cfg.qk_norm:
            q = self._norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = self._norm(k, lw.k_norm, cfg.rms_norm_eps)
        cos_q, sin_q = cos[:, None], sin[:, None]  # [S, 1, Q, Dr]
        rotate_keys = None
        if rotated:
            pass
        elif not cache.store_pre_rope:  # after q/k norm (Qwen3, Gemma 3)
            q = rope(q, cos_q, sin_q)
            k = rope(k, cos_q, sin_q)
        elif rope_mode == "original":
            q = rope(q, cos_q, sin_q)
            rotate_keys = functools.partial(self._rotate_at, table=self._rotary_of(li))
        else:  # re-indexed: query at its slot in the cache, keys at their slot index
            lens = plan.lengths[:, li]  # [S, H]
            qslot = lens.unsqueeze(-1) - Q + torch.arange(Q, device=lens.device)  # [S, H, Q]
            cq, sq = self._rotary_of(li).lookup(qslot, plan.tables.shape[-1] * cache.block_size - 1)  # [S, H, Q, Dr]
            q = rope(q.reshape(S, H, G, Q, D), cq[:, :, None], sq[:, :, None]).view(S, Hq, Q, D)
            rotate_keys = functools.partial(self._rotate_at_slot, table=self._rotary_of(li))
        cache.write(li, plan, k, v)
        hooks.before_attention(li, g, q)  # the method cuts the layer's K/V: the chunk attends to what it keeps
        retrieval = _retrieval(cache)
        pages = retrieval.pages_for(li) if retrieval is not None and g.phase == "decode" and Q == 1 else 0
        scale = cfg.attn_scale or cfg.head_dim ** -0.5
        if pages:  # the method's top blocks only (kvbench.runtime.cache.page_retrieval)
            out, key_scores = attend_retrieved(cache, li, q, plan, scale, pages, backend), None
        else:
            out, key_scores = cache.attend(
                li, q, plan, scale, backend=backend, return_key_scores=hooks.need_scores,
                rotate_keys=rotate_keys, causal=Q > 1,
            )
        hooks.after_attention(li, g, q, key_scores, hidden)
        return out

    def _rotary_of(self, layer: int) -> RotaryTable:
        """The RoPE table of `layer`: the sliding layers' own where the model has one (Gemma 3), else the model's."""
        if self.rotary_local is not None and self.config.attention(layer).window is not None:
            return self.rotary_local
        return self.rotary

    def _rotate_at(self, k: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
        """k [S, H, T, D] stored before RoPE, rotated at the keys' original positions [S, H, T] (none past the
        step's queries, whose lookup already sized the table: no device read)."""
        cos, sin = table.lookup(positions, table.cos.shape[0] - 1)
        return rope(k, cos, sin)

    def _rotate_at_slot(self, k: torch.Tensor, positions: torch.Tensor, table: RotaryTable) -> torch.Tensor:
        """k [S, H, T, D] stored before RoPE, rotated at slot index 0..T-1 (StreamingLLM re-indexing)."""
        T = k.shape[2]
        cos, sin = table.lookup(torch.arange(T, device=k.device), T - 1)
        return rope(k, cos, sin)


@dataclass
class StepRows:
    """Where each group's tokens sit in a step's flat token list, and their RoPE rows."""

    sizes: list[int]  # tokens per group (S_g * Q_g)
    offsets: list[int]  # each group's first row
    cos: torch.Tensor  # [N, Dr] the full layers' RoPE (Dr = rotary dims: D unless partial)
    sin: torch.Tensor
    local: tuple[torch.Tensor, torch.Tensor] | None  # the sliding layers' own (cos, sin) where they differ


def _retrieval(cache: Any) -> Any:
    """The cache's copy of the method's page retrieval (set by the engine), or None; a capturing cache of the
    calibration forward (quant.calibration) has none."""
    return getattr(cache, "page_retrieval", None)


def _gemv_rows(groups: list[RaggedGroup]) -> int | None:
    """A pure decode step (one token per sequence) may take the C GEMV up to GEMV_MAX_ROWS rows (linear.Linear)."""
    if len(groups) == 1 and groups[0].phase == "decode" and groups[0].tokens.shape[1] == 1:
        return cpu_kernels.GEMV_MAX_ROWS
    return None


def count_decode_reads(groups: list[RaggedGroup], cache: PagedKVCache, num_layers: int) -> None:
    """The K/V bytes one-token decode steps read, beside what full attention would (cache.decode_reads): every block
    of the layers that read whole tables (a retrieving layer counts its own selection, attend_retrieved or the fused
    step). A plan with no host lengths is a captured graph's static one: serving.decode_graphs counts the replays."""
    retrieval = _retrieval(cache)
    for g in groups:
        if g.phase == "decode" and g.tokens.shape[1] == 1 and g.plan.host_lengths is not None:
            cache.decode_reads.step(g.tokens.shape[0], cache.uncompressed_read_bytes(g.plan.slot_list))
            dense = [li for li in range(num_layers) if retrieval is None or not retrieval.pages_for(li)]
            if dense:
                cache.decode_reads.read(cache.decode_read_bytes(g.plan, dense))


def attend_retrieved(cache: PagedKVCache, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, pages: int,
                     backend: AttentionBackend) -> torch.Tensor:
    """Decode attention of q [S, Hq, 1, D] over the method's top `pages` blocks of `layer` only
    (kvbench.runtime.cache.page_retrieval), the summaries scored and the blocks read counted; out [S, Hq, 1, D]."""
    out, read = cache.attend_pages(layer, q, plan, scale, pages, backend=backend)
    held = int(blocks_for_tokens(plan.host_lengths_array()[:, layer], cache.block_size).sum())
    cache.decode_reads.scored(held * cache.summaries.bytes_per_block)
    cache.decode_reads.read(read)
    return out


def slide_windows(cache: PagedKVCache, layer: int, groups: list[RaggedGroup], window: int) -> None:
    """A sliding layer's ring: blocks no later query of the layer can see go back to the pool."""
    cache.slide_window(layer, [s for g in groups for s in g.plan.slot_list], window)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated on its first Dr dims by cos / sin [..., Dr] (broadcastable); the rest passes through
    (partial rotary: Phi-3's partial_rotary_factor, GPT-NeoX style)."""
    Dr = cos.shape[-1]
    if Dr == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :Dr], cos, sin), x[..., Dr:]], dim=-1)
