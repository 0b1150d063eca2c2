"""The one place tests build a model: tiny random transformers models of every supported family, and the same
models in the kvbench runtime.

    tiny_hf_model("qwen2", seed=5)                                   # a family's model, default sizes
    tiny_hf_model(vocab=256, eager=True, **DISTINCT_SCORES)          # a sharpened Llama for reference tests
    tiny_model(vocab=256, hidden=384, heads=6, head_dim=64, intermediate=256, max_positions=2048)  # kvbench's
"""
from __future__ import annotations

from typing import Any

import torch
import transformers as tf

from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.model.forward import LlamaFamilyModel

FAMILIES = ["llama", "llama3", "tied", "mistral", "qwen2", "qwen3"]
# The architectures of issue 60, each with a window shorter than its tests' contexts (WINDOW tokens) where it has one:
# Mistral with its sliding_window set, Gemma 3 (five local layers per global one, here 3 + 1) and Gemma 2 (alternating,
# soft-capped), Phi-3 (fused projections) and Phi-4-mini's shape (partial rotary), an MQA Llama (one kv-head), GPT-OSS
# (sinks, experts) and DeepSeek-V2-Lite's shape (MLA)
WINDOW = 24
ARCH_FAMILIES = ["mistral_window", "gemma3", "gemma2", "phi3", "phi4mini", "mqa", "gpt_oss", "deepseek_v2"]

# family -> (transformers config class, the family's own config settings)
_FAMILY_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (tf.LlamaConfig, {}),
    "llama3": (tf.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "tied": (tf.LlamaConfig, {"tie_word_embeddings": True}),
    "mistral": (tf.MistralConfig, {"sliding_window": None}),
    "qwen2": (tf.Qwen2Config, {}),
    "qwen3": (tf.Qwen3Config, {"head_dim": 16}),
    "mistral_window": (tf.MistralConfig, {"sliding_window": WINDOW}),
    "gemma3": (tf.Gemma3TextConfig, {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                                     "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
                                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1000000.0}}}),
    "gemma2": (tf.Gemma2Config, {"head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                                 "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "phi3": (tf.Phi3Config, {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}),
    "phi4mini": (tf.Phi3Config, {"pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1, "partial_rotary_factor": 0.75, "sliding_window": WINDOW}),
    "mqa": (tf.LlamaConfig, {"num_key_value_heads": 1}),
    # DeepSeek-V2-Lite's shape: MLA (no q_lora_rank), one dense layer then MoE with a shared expert
    "deepseek_v2": (tf.DeepseekV2Config, {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
                                          "qk_nope_head_dim": 16,
                                          "qk_rope_head_dim": 8, "v_head_dim": 16, "head_dim": 8, "n_routed_experts": 4,
                                          "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
                                          "first_k_dense_replace": 1, "topk_method": "greedy", "n_group": 1,
                                          "topk_group": 1, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1,
                                          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                              "original_max_position_embeddings": 256,
                                                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                                              "mscale_all_dim": 0.707}}),
    "gpt_oss": (tf.GptOssConfig, {"head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 4,
                                  "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1,
                                  "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "rope_theta": 150000.0, "truncate": False,
                                                      "original_max_position_embeddings": 32}}),
}
# families whose layers need more than 2 to show their layer types (Gemma 3's 3 local + 1 global)
_FAMILY_LAYERS = {"gemma3": 4}

# Presets to spread into tiny_hf_model / tiny_model (**PRESET).
# Weight scales, for tests that need more than a random init's near-uniform heads:
DISTINCT_SCORES = {"qk_scale": 4}  # sharper attention: distinct scores, no near-ties
SHARP_LOGITS = {"qk_scale": 6, "v_scale": 4, "lm_head_scale": 10}  # sharper attention and logits: KV errors show in
# the log-probabilities
# The C kernels' head dim, 64 (6 query heads over the 2 kv-heads):
HEAD_DIM_64 = {"hidden": 384, "heads": 6, "intermediate": 256, "head_dim": 64, "max_positions": 2048}
# SmolLM2's special token ids, for a model given SmolLM2's tokenizer:
SMOLLM2_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def tiny_config(family: str = "llama", *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, vocab: int = 320, max_positions: int = 1024, head_dim: int | None = None,
                eager: bool = False, **extra: Any) -> tf.PretrainedConfig:
    """The transformers config of a tiny `family` model (one of FAMILIES); `extra` are further config fields
    (bos_token_id, ...). head_dim=None keeps the family's (hidden // heads unless the family sets one);
    eager=True selects transformers' eager attention (it returns attention probabilities)."""
    if family not in _FAMILY_CONFIGS:
        raise ValueError(family)
    config_class, family_settings = _FAMILY_CONFIGS[family]
    settings = dict(hidden_size=hidden, intermediate_size=intermediate,
                    num_hidden_layers=max(layers, _FAMILY_LAYERS.get(family, 0)),
                    num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                    max_position_embeddings=max_positions)
    settings.update(family_settings)
    if head_dim is not None:
        settings["head_dim"] = head_dim
    settings.update(extra)  # the caller's fields win over the family's (token ids)
    cfg = config_class(**settings)
    if eager:
        cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(family: str = "llama", seed: int = 0, *, qk_scale: float | None = None,
                  v_scale: float | None = None, lm_head_scale: float | None = None, **config: Any) -> Any:
    """A small randomly initialised causal LM of `family` (torch seeded with `seed`), in eval mode; `config` goes to
    tiny_config. qwen2 gets random qkv biases and qwen3 random q/k norms, so those paths are exercised. The scales
    multiply every layer's q and k projections (qk_scale), v projections (v_scale) and the lm head."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(family, **config)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if family == "qwen2":
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
            if family in ("qwen3", "gemma3"):
                attn.q_norm.weight.normal_(1, 0.3)
                attn.k_norm.weight.normal_(1, 0.3)
            if family == "gpt_oss":  # sinks that matter (the init's are ~0.02)
                attn.sinks.normal_(0, 1)
            if family.startswith("gemma"):  # Gemma norms scale by 1 + w (w = 0 at init): random w
                for name, mod in layer.named_modules():
                    if name.endswith("layernorm"):
                        mod.weight.normal_(0, 0.3)
            if qk_scale is not None and family == "deepseek_v2":  # MLA: q and kv_b_proj's key rows (the latent is
                attn.q_proj.weight.mul_(qk_scale)  # normed, so its projection carries the scale)
                kv_b = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)
                kv_b[:, : attn.qk_nope_head_dim].mul_(qk_scale)
            elif qk_scale is not None and family.startswith("phi"):  # fused: the q and k rows of qkv_proj
                rows = attn.qkv_proj.weight.shape[0] - attn.num_key_value_heads * attn.head_dim
                attn.qkv_proj.weight[:rows].mul_(qk_scale)
            elif qk_scale is not None:
                attn.q_proj.weight.mul_(qk_scale)
                attn.k_proj.weight.mul_(qk_scale)
            if v_scale is not None:
                attn.v_proj.weight.mul_(v_scale)
        if lm_head_scale is not None:
            model.lm_head.weight.mul_(lm_head_scale)
    return model


def tiny_model(family: str = "llama", seed: int = 0, *, tokenizer: Any = None, dtype: torch.dtype | None = None,
               **hf_settings: Any) -> LlamaFamilyModel:
    """tiny_hf_model(family, seed, **hf_settings) in the kvbench runtime (weights cast to `dtype` if given), with
    `tokenizer` attached as model.tokenizer for methods that tokenize text of their own."""
    model = build_from_transformers(tiny_hf_model(family, seed, **hf_settings), dtype=dtype)
    if tokenizer is not None:
        model.tokenizer = tokenizer
    return model


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[<=t]) from one full forward of the transformers model."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)[:-1]
    return lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


class ByteTokenizer:
    """A stand-in tokenizer for the tiny models (no chat template): text -> its UTF-8 bytes modulo `vocab`.
    Methods that tokenize text of their own (kvzip's reconstruction prompt, duo_attention's calibration essays)
    read `model.tokenizer`; a tiny model has no real one."""

    chat_template = None

    def __init__(self, vocab: int = 256):
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % self.vocab for b in text.encode("utf-8")]
