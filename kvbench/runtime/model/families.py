"""Weights of a transformers causal LM copied into the kvbench runtime, one reader per family.

    build_from_transformers(hf_model, dtype=None, device=None) -> LlamaFamilyModel

Families (the config's model_type):
    llama, mistral, qwen2, qwen3   separate q/k/v and gate/up projections fused here; Qwen2's qkv bias; Qwen3's QK-norm
    phi3                           qkv_proj and gate_up_proj already fused; partial rotary (partial_rotary_factor)
    gemma2, gemma3_text, gemma3    (1 + w) RMSNorms, sandwich norms, sqrt(hidden) embedding scale, gelu-tanh MLP,
                                   query_pre_attn_scalar, local/global layers (Gemma 3: their own RoPE bases),
                                   Gemma 3's QK-norm, Gemma 2's soft-capping (attention and final logits); gemma3 is
                                   the multimodal checkpoint, whose language model is read (text only)
    gpt_oss                        learned attention sinks per head, alternating sliding / full layers, qkv and o
                                   biases, yarn RoPE, a mixture-of-experts MLP (runtime.model.moe: a plain loop)
    deepseek_v2                    multi-head latent attention (runtime.model.mla: the cache holds the latent and the
                                   RoPE key), interleaved yarn RoPE; its MoE MLP is transformers' module (HFModule)
Every family's per-layer attention type (full or sliding(window)) comes from the config
(attention_types.layer_windows_from_hf). Weights are read from the modules (not state-dict names), so a
multimodal checkpoint's language model reads like a text-only one.
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from kvbench.run.model_checks import exact_positions
from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.backends.cpu.quant_linear import QuantEmbedding, QuantLinear
from kvbench.runtime.model.attention_types import LayerAttention, layer_windows_from_hf
from kvbench.runtime.model.forward import SUPPORTED_MODEL_TYPES, LayerWeights, LlamaFamilyModel, ModelConfig
from kvbench.runtime.model.mla import MLAConfig, MLAWeights
from kvbench.runtime.model.moe import MoEMLP
from kvbench.runtime.model.quantized_weights import QuantizedWeights
from kvbench.runtime.model.rope import RotaryTable

GEMMA = ("gemma2", "gemma3_text", "gemma3")
ROPE_TABLE_POSITIONS = 8192  # positions precomputed (the table grows on demand)


def text_config(hc: Any) -> Any:
    """The decoder's config (a multimodal checkpoint's text_config)."""
    get = getattr(hc, "get_text_config", None)
    return get() if get is not None else hc


def decoder(hf_model: Any) -> Any:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a causal LM, or of a multimodal model's
    language model."""
    base = hf_model.model
    return getattr(base, "language_model", base)


def build_from_transformers(hf_model: Any, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None,
                quantized: QuantizedWeights | None = None) -> LlamaFamilyModel:
    """A LlamaFamilyModel with the weights of `hf_model` (cast to dtype, moved to device); with `quantized` (a GGUF
    file's blocks, fp32 on CPU), the projections and embeddings it keeps multiply those blocks instead."""
    mt = getattr(hf_model.config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hc = text_config(hf_model.config)
    dm = decoder(hf_model)
    ref = dm.embed_tokens.weight
    dtype = dtype or ref.dtype
    device = torch.device(device) if device is not None else ref.device

    def t(w: torch.Tensor) -> torch.Tensor:
        return w.detach().to(device=device, dtype=dtype).contiguous()

    def linear(*mods: Any) -> Linear:  # [out, in] weights concatenated (biases too, where present)
        biases = [m.bias for m in mods if getattr(m, "bias", None) is not None]
        bias = torch.cat([t(b) for b in biases]) if len(biases) == len(mods) else None
        kept = quantized.linear(mods, hf_model, bias) if quantized is not None else None
        return kept if kept is not None else Linear(torch.cat([t(m.weight) for m in mods]), bias)

    gemma = mt in GEMMA
    num_heads = hc.num_attention_heads
    head_dim = getattr(hc, "head_dim", None) or hc.hidden_size // num_heads
    mla = None
    if mt == "deepseek_v2":  # one cached row per token: the latent and the RoPE key
        mla = MLAConfig(hc.kv_lora_rank, hc.qk_nope_head_dim, hc.qk_rope_head_dim, hc.v_head_dim, hc.q_lora_rank)
        head_dim = mla.row_dim
    windows = layer_windows_from_hf(hc)
    attn_softcap = getattr(hc, "attn_logit_softcapping", None) if mt == "gemma2" else None  # Gemma 3: not applied
    sinks = mt == "gpt_oss"
    layer_attention = tuple(LayerAttention(window=w, softcap=attn_softcap, has_sinks=sinks) for w in windows)
    if all(a.plain for a in layer_attention):
        layer_attention = ()
    cfg = ModelConfig(
        model_type=mt, vocab_size=hc.vocab_size, hidden_size=hc.hidden_size, num_layers=hc.num_hidden_layers,
        num_heads=num_heads, head_dim=head_dim,
        num_kv_heads=1 if mla is not None else getattr(hc, "num_key_value_heads", None) or num_heads,
        intermediate_size=hc.intermediate_size, rms_norm_eps=hc.rms_norm_eps,
        qkv_bias=mt == "qwen2" or bool(getattr(hc, "attention_bias", False)),
        qk_norm=mt in ("qwen3", "gemma3_text", "gemma3"),
        tie_word_embeddings=bool(getattr(hc, "tie_word_embeddings", False) or
                                 getattr(hf_model.config, "tie_word_embeddings", False)),
        # the positions kvbench's RoPE computes as transformers does (longrope: up to its original length)
        max_position_embeddings=exact_positions(hc.to_dict()) or getattr(hc, "max_position_embeddings", 4096),
        family="gemma" if gemma else "gpt_oss" if mt == "gpt_oss" else "llama", layer_attention=layer_attention,
        attn_scale=(hc.query_pre_attn_scalar ** -0.5 if gemma else
                    float(dm.layers[0].self_attn.scaling) if mla is not None else None),  # MLA: yarn's mscale in it
        mla=mla,
        final_softcap=getattr(hc, "final_logit_softcapping", None) if gemma else None,
        embed_scale=hc.hidden_size ** 0.5 if gemma else None,
        mlp_act="gelu_tanh" if gemma else "silu",
    )

    def norm_weight(mod: Any) -> torch.Tensor:  # Gemma's RMSNorm scales by 1 + w: stored so
        w = mod.weight.detach().float()
        return t(w + 1.0 if gemma else w)

    layers = []
    for layer in dm.layers:
        at, mlp = layer.self_attn, layer.mlp
        moe = down = mla_w = None
        if mla is not None:
            qkv = gate_up = None
            mla_w = mla_weights(at, mla, num_heads, t, linear)
            if hasattr(mlp, "experts"):  # transformers' MoE module (shared and routed experts), cast and moved
                moe = HFModule(copy.deepcopy(mlp).to(device=device, dtype=dtype))
            else:
                gate_up = linear(mlp.gate_proj, mlp.up_proj)
        elif mt == "phi3":  # already fused: q, k, v rows and gate, up rows in kvbench's order
            qkv, gate_up = linear(at.qkv_proj), linear(mlp.gate_up_proj)
        elif mt == "gpt_oss":
            qkv, gate_up = linear(at.q_proj, at.k_proj, at.v_proj), None
            ex = mlp.experts
            moe = MoEMLP(t(mlp.router.weight), t(mlp.router.bias), t(ex.gate_up_proj), t(ex.gate_up_proj_bias),
                         t(ex.down_proj), t(ex.down_proj_bias), hc.num_experts_per_tok, float(ex.alpha),
                         float(ex.limit))
        else:
            qkv, gate_up = linear(at.q_proj, at.k_proj, at.v_proj), linear(mlp.gate_proj, mlp.up_proj)
        if gate_up is not None:
            down = linear(mlp.down_proj)
        layers.append(LayerWeights(
            ln_attn=norm_weight(layer.input_layernorm),
            qkv=qkv,
            o=linear(at.o_proj),
            # Gemma: the pre-MLP norm is pre_feedforward_layernorm; post_attention_layernorm is the sandwich's
            ln_mlp=norm_weight(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm),
            gate_up=gate_up,
            down=down,
            q_norm=norm_weight(at.q_norm) if cfg.qk_norm else None,
            k_norm=norm_weight(at.k_norm) if cfg.qk_norm else None,
            post_attn_norm=norm_weight(layer.post_attention_layernorm) if gemma else None,
            post_mlp_norm=norm_weight(layer.post_feedforward_layernorm) if gemma else None,
            sinks=t(at.sinks) if sinks else None,
            moe=moe,
            mla=mla_w,
        ))
    embed = quantized.embedding(dm.embed_tokens, hf_model) if quantized is not None else None
    embed = embed if embed is not None else t(dm.embed_tokens.weight)
    head = hf_model.get_output_embeddings()
    if cfg.tie_word_embeddings or head is None:  # the embeddings' own matrix (its blocks, when kept)
        lm_head = QuantLinear([embed.matrix]) if isinstance(embed, QuantEmbedding) else Linear(embed)
    else:
        lm_head = linear(head)
    rotary, rotary_local = rope_tables(dm.rotary_emb, hc, dtype, device)
    cfg.rotary_dim = rotary.inv_freq.numel() * 2
    return LlamaFamilyModel(cfg, embed, layers, norm_weight(dm.norm), lm_head, rotary, rotary_local)


class HFModule:
    """A transformers MLP module (cast to the model dtype, on its device) as h [N, E] -> [N, E]: DeepSeek's MoE,
    whose routing (group-limited top-k, shared experts) is transformers' own."""

    def __init__(self, module: Any):
        self.module = module.eval()

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.module.parameters())

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.module(h[None])[0]


def mla_weights(at: Any, mla: MLAConfig, num_heads: int, t: Any, linear: Any) -> MLAWeights:
    """MLA's projections from a DeepseekV2Attention: kv_b_proj split per head into W_UK [Hq, nope, r] and W_UV
    [Hq, v, r] (the absorbed form's)."""
    kv_b = t(at.kv_b_proj.weight).view(num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk, w_uv = kv_b.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    q = dict(q=linear(at.q_proj)) if mla.q_lora_rank is None else dict(
        q_a=linear(at.q_a_proj), q_a_norm=t(at.q_a_layernorm.weight), q_b=linear(at.q_b_proj))
    return MLAWeights(kv_a=linear(at.kv_a_proj_with_mqa), kv_a_norm=t(at.kv_a_layernorm.weight),
                      w_uk=w_uk.contiguous(), w_uv=w_uv.contiguous(), **q)


def rope_tables(rot: Any, hc: Any, dtype: torch.dtype, device: torch.device) -> tuple[RotaryTable,
                                                                                        RotaryTable | None]:
    """(the full layers' RoPE table, the sliding layers' where it differs) from transformers' rotary module: one
    inv_freq for most models; Gemma 3's one per layer type (rope_local_base_freq for the sliding layers)."""
    n = min(getattr(hc, "max_position_embeddings", 4096) or 4096, ROPE_TABLE_POSITIONS)

    def table(inv_freq: torch.Tensor, scaling: float) -> RotaryTable:
        return RotaryTable(inv_freq.to(device), scaling, dtype, max_positions=n)

    if hasattr(rot, "inv_freq"):
        return table(rot.inv_freq, getattr(rot, "attention_scaling", 1.0)), None
    full = table(getattr(rot, "full_attention_inv_freq"), getattr(rot, "full_attention_attention_scaling", 1.0))
    local = None
    if hasattr(rot, "sliding_attention_inv_freq"):
        local = table(rot.sliding_attention_inv_freq, getattr(rot, "sliding_attention_attention_scaling", 1.0))
    return full, local
