"""A GGUF file's header read as the transformers config its loader builds, without reading the tensors.

    GGUF_MODEL_TYPES                    GGUF architecture -> transformers model_type, for the families kvbench runs
                                        that transformers' GGUF reader carries
    check_gguf_architecture(meta, where) -> UserError (one line) for a GGUF kvbench cannot load
    hf_config_from_gguf(meta)           -> the config dict transformers' load_gguf_checkpoint builds from these keys
    restore_rope_scaling(config, meta)  -> puts back Gemma 3's global-layer RoPE scaling, which transformers drops

transformers reads a GGUF's `<arch>.*` keys through its table (transformers.integrations.ggml.GGUF_CONFIG_MAPPING);
every field the file lacks keeps the family's default (transformers' config class): Gemma 3's layer pattern (five
sliding layers per full one) and its local RoPE base (10,000), Gemma's query_pre_attn_scalar and soft-capping, Qwen3's
head_dim (its reader ignores key_length). Reading the same table here gives `kvbench-info` and the plan the model
transformers will load, in milliseconds (transformers' own reader parses every tensor and token: tens of seconds on a
262k vocabulary). Two fields need the tensors or the token list and are left out: tie_word_embeddings and, where the
file has no `<arch>.vocab_size`, vocab_size (the KV shape needs neither).
"""
from __future__ import annotations

from typing import Any

from kvbench.errors import UserError

# llama.cpp's architecture names -> transformers' model types: the intersection of kvbench's families
# (forward.SUPPORTED_MODEL_TYPES) and what transformers' GGUF reader loads whole. Mistral files are written as llama
# (GGUF has no mistral architecture). Left out: DeepSeek-V2's deepseek2 (transformers has no reader for it) and
# gpt-oss (transformers 5.25's name map gives the experts' gate_up_proj and biases no GGUF name: they would load
# missing).
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                    "gemma3": "gemma3_text"}


def check_gguf_architecture(meta: dict, where: str) -> None:
    """Refuse a GGUF whose general.architecture kvbench cannot load (one line naming the supported ones)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_MODEL_TYPES:
        raise UserError(f"{where}: unsupported GGUF architecture {arch!r}; kvbench loads GGUF files of "
                        f"{', '.join(sorted(GGUF_MODEL_TYPES))} (transformers' GGUF reader); for another family use "
                        f"its Hugging Face checkpoint")


def hf_config_from_gguf(meta: dict) -> dict[str, Any]:
    """The config transformers builds from a GGUF header `meta` (model_files.read_gguf_header), as a dict for
    AutoConfig.for_model: the same key table and renames as transformers' load_gguf_checkpoint."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = meta["general.architecture"]  # none of GGUF_MODEL_TYPES is renamed by transformers' reader
    cfg: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, value in meta.items():
        if value is None:  # a long array the header reader skipped (token scores, ...): never a config field
            continue
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest, -1)
        if renamed not in (None, -1):
            cfg[renamed] = value
    if cfg.get("model_type") == "gemma3":  # a Gemma 3 GGUF holds the text model only
        cfg["model_type"] = "gemma3_text"
    return cfg


def restore_rope_scaling(config: Any, meta: dict) -> bool:
    """Put a Gemma 3 file's `gemma3.rope.scaling.type` / `.factor` (llama.cpp writes linear x8 for 4B and up: the
    global layers' positions divided by 8) back into the transformers `config` its reader built without them; True
    when it changed the config. transformers' table has no key for them, so a Gemma 3 4B+ GGUF would otherwise run
    its global layers with unscaled RoPE at every position. Other families' files are left as transformers reads
    them."""
    if meta.get("general.architecture") != "gemma3" or meta.get("gemma3.rope.scaling.type") is None:
        return False
    kind, factor = meta["gemma3.rope.scaling.type"], meta.get("gemma3.rope.scaling.factor")
    if kind != "linear" or not factor or float(factor) == 1.0:
        if kind in ("none", "linear"):
            return False
        raise UserError(f"gemma3.rope.scaling.type={kind!r} in the GGUF header: kvbench reads Gemma 3's linear "
                        f"scaling only")
    params = dict(getattr(config, "rope_parameters", None) or {})
    full = dict(params.get("full_attention") or {})
    full.update(rope_type="linear", factor=float(factor))
    params["full_attention"] = full
    config.rope_parameters = params
    return True
