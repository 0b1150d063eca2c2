"""Can kvbench run this model, and do its weights match its config: checked from the files, before any load.

    check_config(cfg, where, supported)      -> UserError (one line) for a config.json kvbench cannot run
    check_weights(folder, where)             -> UserError naming missing / unexpected / mismatched tensors
    loading_report(info, where)              -> the same line from transformers' load report, or None

kvbench runs the model's forward itself (kvbench/runtime/model/forward.py and families.py: Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 2 / 3): a config it cannot honour would give numbers without a word of warning. Refused from config.json
alone: an unsupported `model_type`, custom code (`auto_map`), sizes that are not positive integers (num_key_value_heads
0, a negative max_position_embeddings), a hidden size its heads do not divide (unless the model type takes a head_dim of
its own), kv-heads that do not divide the heads, an activation other than the family's (SiLU; Gemma's tanh GELU), MLP
biases, and an attention window kvbench cannot honour. Sliding windows are honoured (kvbench.runtime.model.
attention_types: `layer_types` of full_attention / sliding_attention with a positive `sliding_window`, Mistral's and
Phi-3's `sliding_window` on every layer, Qwen2's `use_sliding_window` through the layer_types transformers derives);
refused: other layer types (chunked attention, ...), a window that is not a positive integer, Gemma 3's bidirectional
attention.
Multimodal configs (Gemma 3's) are checked on their text_config. DeepSeek-V2's hub configs keep an `auto_map` to their
original code: transformers' native class is what loads (kvbench never passes trust_remote_code), so it passes.

Weights: a safetensors folder's tensor names and shapes (read from the files' headers, never the tensors) against
those of the model its config.json describes (built by transformers on the meta device: no memory, no weights).
A folder of .bin files is checked by the loader instead (`loading_report` on transformers' own report).

This module imports only kvbench.errors and kvbench.console at import time (transformers when a check needs it), so
both the app's plan and the runtime's loader use it.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, Iterable, Optional

from kvbench.console import quiet_transformers
from kvbench.errors import UserError

_POSITIVE = ("num_hidden_layers", "num_attention_heads", "hidden_size")
# null or absent: the model type's default (transformers'), or, for num_key_value_heads, the number of heads
_POSITIVE_OR_NULL = ("num_key_value_heads", "max_position_embeddings", "head_dim", "intermediate_size", "vocab_size")
_SHOWN = 4  # tensor names shown per kind
# model types whose head_dim may differ from hidden_size / heads
OWN_HEAD_DIM = ("mistral", "qwen3", "gemma2", "gemma3_text", "gemma3", "gpt_oss")
GEMMA = ("gemma2", "gemma3_text", "gemma3")
# model types whose hub configs still name their original custom code (auto_map) although transformers has the
# class natively: kvbench loads the native class (it never passes trust_remote_code), so the custom code never runs
NATIVE_DESPITE_AUTO_MAP = ("deepseek_v2",)
HONOURED_LAYER_TYPES = ("full_attention", "sliding_attention")  # kvbench.runtime.model.attention_types
# the model types whose transformers attention reads layer_types (attention_types.LAYER_TYPES_FAMILIES)
LAYER_TYPES_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "gpt_oss")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_config(cfg: Any, where: str, supported: Iterable[str]) -> None:
    """Refuse (UserError, one line starting with `where`) a config.json that kvbench cannot run as written."""
    supported = tuple(supported)
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: config.json is not a JSON object")
    if cfg.get("auto_map") and cfg.get("model_type") not in NATIVE_DESPITE_AUTO_MAP:
        raise UserError(f"{where}: config.json names custom code (auto_map: {', '.join(sorted(cfg['auto_map']))}); "
                        f"kvbench runs its own forward and supports the model types {', '.join(supported)} only")
    model_type = cfg.get("model_type")
    if model_type not in supported:
        raise UserError(f"{where}: unsupported model_type {model_type!r} in config.json; supported: "
                        f"{', '.join(supported)}")
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:  # a multimodal checkpoint
        cfg = {**cfg["text_config"], "model_type": model_type}
    for key in _POSITIVE + _POSITIVE_OR_NULL:
        value = cfg.get(key)
        if value is None and key in _POSITIVE_OR_NULL:
            continue
        if not _is_int(value) or value < 1:
            raise UserError(f"{where}: invalid {key}={value!r} in config.json: expected a positive integer")
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if cfg["hidden_size"] % heads and (cfg.get("head_dim") is None or cfg["model_type"] not in OWN_HEAD_DIM):
        raise UserError(f"{where}: hidden_size={cfg['hidden_size']} in config.json is not divisible by "
                        f"num_attention_heads={heads}"
                        + (f" (a head_dim of its own is honoured for {', '.join(OWN_HEAD_DIM)} only)"
                           if cfg.get("head_dim") is not None else ""))
    if heads % kv_heads:
        raise UserError(f"{where}: num_attention_heads={heads} in config.json is not a multiple of "
                        f"num_key_value_heads={kv_heads}")
    if model_type in GEMMA:
        key, act = "hidden_activation", cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UserError(f"{where}: {key}={act!r} in config.json: kvbench's Gemma forward uses gelu_pytorch_tanh "
                            f"only")
    else:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UserError(f"{where}: hidden_act={act!r} in config.json: kvbench's forward uses silu only")
    if cfg.get("mlp_bias"):
        raise UserError(f"{where}: mlp_bias=true in config.json: kvbench's forward has no MLP biases")
    _check_window(cfg, where)
    _check_rope(cfg, where)


def rope_settings(cfg: dict) -> list[dict]:
    """The RoPE settings of a config.json (`rope_parameters` in transformers 5, `rope_scaling` before; Gemma 3's
    one per layer type), each a dict with its `rope_type` (or older `type`)."""
    out = []
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if not isinstance(value, dict):
            continue
        nested = [v for v in value.values() if isinstance(v, dict)]
        out += nested if nested and not ("rope_type" in value or "type" in value) else [value]
    return out


def _rope_type(params: dict) -> str:
    return str(params.get("rope_type") or params.get("type") or "default")


def exact_positions(cfg: dict) -> Optional[int]:
    """The positions up to which kvbench's RoPE is transformers' for this config.json: max_position_embeddings,
    except longrope (Phi-3.5 / Phi-4-mini), whose short factors kvbench applies everywhere while transformers
    switches the whole forward to the long factors once a position passes original_max_position_embeddings:
    runs stop at that length (refused before the load by the tasks' position checks)."""
    limit = cfg.get("max_position_embeddings")
    for params in rope_settings(cfg):
        if _rope_type(params) == "longrope":
            original = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            if _is_int(original) and original >= 1:
                limit = original if limit is None else min(limit, original)
    return limit


def _check_rope(cfg: dict, where: str) -> None:
    """Refuse a RoPE kvbench does not compute as transformers does: dynamic NTK scaling (transformers rescales the
    frequencies with each forward's sequence length past max_position_embeddings; kvbench's tables are fixed)."""
    for params in rope_settings(cfg):
        if _rope_type(params) == "dynamic":
            raise UserError(f"{where}: rope_type='dynamic' in config.json (dynamic NTK scaling) is not implemented: "
                            f"kvbench's RoPE tables are fixed, transformers rescales them with the sequence length; "
                            f"supported: default, linear, llama3, yarn, longrope (up to "
                            f"original_max_position_embeddings)")


def _check_window(cfg: dict, where: str) -> None:
    """Refuse an attention window kvbench cannot honour (see the module docstring); the others run as the model's."""
    window = cfg.get("sliding_window")
    # layer_types as transformers reads them: only in the families whose attention class does (else ignored)
    types = (cfg.get("layer_types") or []) if cfg["model_type"] in LAYER_TYPES_FAMILIES else []
    bad = sorted({str(t) for t in types if t not in HONOURED_LAYER_TYPES})
    if bad:
        raise UserError(f"{where}: layer_types {bad} in config.json cannot be honoured; kvbench runs "
                        f"{', '.join(HONOURED_LAYER_TYPES)}")
    uses = ("sliding_attention" in types or bool(cfg.get("use_sliding_window"))
            or (window is not None and cfg["model_type"] in ("mistral", "phi3")))
    if cfg["model_type"] in GEMMA and not types:
        uses = window is not None  # transformers derives Gemma's local/global pattern
    if uses and not (_is_int(window) and window >= 1):
        raise UserError(f"{where}: invalid sliding_window={window!r} in config.json: expected a positive integer")
    if cfg.get("use_bidirectional_attention"):
        raise UserError(f"{where}: use_bidirectional_attention=true in config.json: kvbench runs causal decoders only")


def safetensors_shapes(folder: str) -> Optional[dict[str, list[int]]]:
    """{tensor name: shape} over the folder's *.safetensors files, from their headers; None without any."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        return None
    out: dict[str, list[int]] = {}
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > 100_000_000:
                    raise ValueError("header too large")
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as exc:
            raise UserError(f"{path!r} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
        held = os.path.getsize(path) - 8 - n  # the bytes after the header: the tensors' data
        ends = [value["data_offsets"][1] for key, value in header.items() if key != "__metadata__"
                and isinstance(value, dict) and isinstance(value.get("data_offsets"), list)
                and len(value["data_offsets"]) == 2 and isinstance(value["data_offsets"][1], int)]
        if ends and max(ends) > held:  # a copy or download cut short: the load would fail after minutes
            raise UserError(f"{path!r} is truncated: its header describes {max(ends)} bytes of tensors, the file "
                            f"holds {max(held, 0)}")
        for key, value in header.items():
            if key != "__metadata__" and isinstance(value, dict):
                out[key] = list(value.get("shape") or [])
    return out


def expected_shapes(folder: str) -> tuple[dict[str, list[int]], set, list]:
    """({name: shape} of the model config.json describes, names that may be absent (tied to another), regexes of
    names transformers ignores), built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with quiet_transformers():  # transformers' advice on the config (longrope's) is not kvbench's one line
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    tied = getattr(model, "_tied_weights_keys", None) or {}
    may_miss = set(tied) if getattr(config, "tie_word_embeddings", False) else set()
    ignore = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    ignore += list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    ignore.append(r"rotary_emb\.inv_freq$")
    return shapes, may_miss, ignore


def _summary(names: list[str]) -> str:
    """The first names and how many more; a run of layers as its range."""
    layers = sorted({int(m.group(1)) for n in names for m in [re.search(r"\.layers\.(\d+)\.", n)] if m})
    shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
    if len(layers) > 1:
        shown += f" (layers {layers[0]}-{layers[-1]})"
    return shown


def mismatch_line(missing: list[str], unexpected: list[str], mismatched: list[str]) -> Optional[str]:
    """'missing N tensors: ...; unexpected ...; mismatched ...', or None when all three are empty."""
    parts = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)):
        if names:
            parts.append(f"{label} {len(names)} tensor{'s' if len(names) > 1 else ''}: {_summary(sorted(names))}")
    return "; ".join(parts) or None


def check_weights(folder: str, where: str) -> None:
    """Refuse (UserError, one line) a safetensors folder whose tensors are not those of its config.json."""
    found = safetensors_shapes(folder)
    if found is None or _renamed_on_load(folder):
        return
    try:
        shapes, may_miss, ignore = expected_shapes(folder)
    except Exception as exc:  # transformers cannot build it: the loader reports that in its own words
        raise UserError(f"{where}: config.json cannot be built by transformers ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if found and not any(k.startswith("model.") for k in found):  # a base model's checkpoint (no "model." prefix)
        shapes = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in shapes.items()}
    skip = [re.compile(p) for p in ignore]

    def ignored(name: str) -> bool:
        return any(p.search(name) for p in skip)

    missing = [k for k in shapes if k not in found and k not in may_miss and not ignored(k)]
    unexpected = [k for k in found if k not in shapes and not ignored(k)]
    mismatched = [f"{k} {found[k]} vs {shapes[k]}" for k in shapes if k in found and found[k] != shapes[k]]
    line = mismatch_line(missing, unexpected, mismatched)
    if line is not None:
        raise UserError(f"{where}: its weights do not match its config.json ({line}); expected the checkpoint "
                        f"that config.json describes")


def _renamed_on_load(folder: str) -> bool:
    """True when transformers converts this model type's checkpoint names on load (its conversion mapping: DeepSeek's
    per-expert tensors fused, Gemma 3's multimodal names): the files' names are not the modules', so only the
    loader's report after the conversion can tell (`loading_report`)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except (OSError, ValueError, ImportError, AttributeError):
        return False
    return get_checkpoint_conversion_mapping(model_type) is not None


def loading_report(info: Any, where: str, described_by: str = "config.json") -> Optional[str]:
    """The one-line refusal for transformers' load report (output_loading_info=True), or None when it is clean;
    `described_by` names what the weights were held to (a GGUF's header)."""
    if not isinstance(info, dict):
        return None
    mismatched = [" ".join(str(x) for x in (m if isinstance(m, (tuple, list)) else [m]))
                  for m in info.get("mismatched_keys") or []]
    line = mismatch_line(sorted(map(str, info.get("missing_keys") or [])),
                         sorted(map(str, info.get("unexpected_keys") or [])), mismatched)
    if line is None:
        return None
    return f"{where}: its weights do not match its {described_by} ({line}); expected the checkpoint that " \
           f"{described_by} describes"
