"""Tiny random transformers models of every supported family, for reference tests."""
from __future__ import annotations

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024)


def tiny_hf_model(family: str, seed: int = 0):
    """A small randomly initialised causal LM of `family` (llama, llama3, mistral, qwen2, qwen3, tied)."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "llama":
        cfg = tf.LlamaConfig(**COMMON)
    elif family == "llama3":
        cfg = tf.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "tied":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=True)
    elif family == "mistral":
        cfg = tf.MistralConfig(**COMMON, sliding_window=None)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**COMMON)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, head_dim=16)
    else:
        raise ValueError(family)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    if family == "qwen2":  # random biases so the qkv-bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if family == "qwen3":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.3)
                layer.self_attn.k_norm.weight.normal_(1, 0.3)
    return model


FAMILIES = ["llama", "llama3", "tied", "mistral", "qwen2", "qwen3"]


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
