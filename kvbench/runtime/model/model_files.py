"""Is a model location a model at all: one rule set, checked before anything loads.

    check_model_path(path, gguf_file=None, check_hub=False) -> UserError (one line naming the value) when `path` cannot
        be a model: a missing path, a special file, a file that is not a .gguf, an empty folder, a folder without
        config.json (or one .gguf file), weights or a tokenizer, a config.json that is not a decoder's, a GGUF that is
        not GGUF or is corrupt. A hub id ("org/name") is left to the hub, or with check_hub=True (the app's preflight)
        must be in the local Hugging Face cache or on a reachable hub.
    resolve_location(path, gguf_file) -> (path, gguf_file) with packaged:NAME made the assembled file's folder and
        name, and a folder holding one .gguf (no config.json) that folder and file
    gguf_location(path, gguf_file) -> the GGUF file a model location names, or None (a hub id, a model folder)
    read_gguf_header(path, where) -> a GGUF file's metadata (never its tensors)
    cached_hub_config(repo_id)    -> the path of a hub model's config.json in the local cache, or None

Only a config.json or a GGUF header is read (never the weights), so bad input is refused in milliseconds. The app
(kvbench.run.plan, through kvbench.run.model_info) and API callers (kvbench.runtime.model.loading.load_hf) use the same rules.
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Any, BinaryIO, Optional

from kvbench.data import hub
from kvbench.errors import UserError
from kvbench.runtime.model.packaged import is_packaged, packaged_gguf, packaged_name

GGUF_MAGIC = b"GGUF"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(path: str) -> bool:
    """True for a string that reads as a hub id ("org/name"), not a local path."""
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "/", "~"))


def resolve_location(path: Any, gguf_file: Optional[str] = None) -> tuple[Any, Optional[str]]:
    """(path, gguf_file) as the loader opens them: packaged:NAME -> the folder and file assembled from its packages
    (kvbench.runtime.model.packaged); a folder without config.json that holds exactly one .gguf -> (folder, that
    file). Anything else unchanged (a folder with several .gguf files is check_model_path's to refuse)."""
    if is_packaged(path):
        if gguf_file is not None:
            raise UserError(f"model.path={path!r} is a packaged model: leave model.gguf_file unset")
        return packaged_gguf(packaged_name(path))
    if gguf_file is None and path is not None:
        local = os.path.expanduser(str(path))
        if os.path.isdir(local) and not os.path.isfile(os.path.join(local, "config.json")):
            ggufs = _gguf_files(local)
            if len(ggufs) == 1:
                return path, ggufs[0]
    return path, gguf_file


def gguf_location(path: Any, gguf_file: Optional[str] = None) -> Optional[str]:
    """The GGUF file a model location names (path/gguf_file, a .gguf path, the one .gguf of a folder without
    config.json, a packaged model's), or None for a hub id or a model folder."""
    if path is None:
        return None
    path, gguf_file = resolve_location(path, gguf_file)
    local = os.path.expanduser(str(path))
    if gguf_file is not None:
        return os.path.join(local, str(gguf_file))
    return local if os.path.isfile(local) and local.endswith(".gguf") else None


def _gguf_files(folder: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(folder) if n.endswith(".gguf")
                      and os.path.isfile(os.path.join(folder, n)))
    except OSError:
        return []


def check_model_path(path: Any, gguf_file: Optional[str] = None, *, check_hub: bool = False) -> None:
    """Refuse a model location (model.path, and model.gguf_file inside it) that cannot be a model, in one line."""
    path, gguf_file = resolve_location(path, gguf_file)
    label = f"model.path={str(path)!r}"
    local = os.path.expanduser(str(path))
    if not os.path.exists(local):
        if is_hub_id(str(path)) and gguf_file is None:
            if check_hub:
                _check_hub_model(str(path))  # the loader fetches it; refused now if it cannot be had
            return
        raise UserError(f"{label} does not exist (a local folder, a .gguf file or a hub id "
                        f"like HuggingFaceTB/SmolLM2-135M-Instruct)")
    if not (os.path.isdir(local) or os.path.isfile(local)):  # /dev/null, a FIFO, a socket: never opened
        raise UserError(f"{label} is not a regular file or folder: expected a model folder "
                        f"(config.json + weights) or a .gguf file")
    if gguf_file is not None:
        if not os.path.isdir(local):
            raise UserError(f"{label} is a file; with model.gguf_file it must be the folder holding that file")
        read_gguf_header(os.path.join(local, str(gguf_file)), f"model.gguf_file={gguf_file!r}")
        return
    if os.path.isfile(local):
        if local.endswith(".gguf"):
            read_gguf_header(local, label)
            return
        raise UserError(f"{label} is a file but not a .gguf file: expected a model folder "
                        f"(config.json + weights) or a .gguf file")
    names = set(os.listdir(local))
    if not names:
        raise UserError(f"{label} is an empty folder: expected a Hugging Face model folder "
                        f"(config.json, tokenizer and weights) or a .gguf file")
    if "config.json" not in names or not os.path.isfile(os.path.join(local, "config.json")):
        ggufs = _gguf_files(local)
        if len(ggufs) > 1:
            raise UserError(f"{label} holds several .gguf files ({', '.join(ggufs)}): name one with "
                            f"model.gguf_file=FILE or give its path")
        raise UserError(f"{label} is a folder without config.json or a .gguf file: expected a Hugging Face "
                        f"model folder (config.json, tokenizer and weights) or a .gguf file")
    if not any(n.endswith(WEIGHT_SUFFIXES) for n in names):
        raise UserError(f"{label} has no weights (*.safetensors or *.bin)")
    if not names & set(TOKENIZER_FILES):
        raise UserError(f"{label} has no tokenizer ({', '.join(TOKENIZER_FILES)})")
    try:
        with open(os.path.join(local, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UserError(f"{label}: config.json is not readable JSON ({exc})") from None
    if not isinstance(cfg, dict) or "num_hidden_layers" not in cfg and not isinstance(cfg.get("text_config"), dict):
        raise UserError(f"{label}: config.json does not describe a decoder model (no num_hidden_layers)")


def cached_hub_config(repo_id: str) -> Optional[str]:
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
    if cached_hub_config(repo_id) is not None:
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


# --------------------------------------------------------------------------- a GGUF header, without the tensors
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_MAX_KV = 1 << 16
_MAX_STR = 1 << 24


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data


def _value(f: BinaryIO, vtype: int, depth: int = 0, strings: bool = False) -> Any:
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
        if n <= 16 or (strings and itype == 8 and n <= _MAX_KV_STRINGS):
            return [_value(f, itype, depth + 1) for _ in range(n)]
        return _skip_strings(f, itype, n)
    raise ValueError(f"unknown GGUF value type {vtype}")


_MAX_KV_STRINGS = 1 << 22  # the longest string array read (a tokenizer's tokens)


def _skip_strings(f: BinaryIO, itype: int, n: int) -> None:
    if itype != 8:
        raise ValueError("nested GGUF array")
    for _ in range(n):
        (m,) = struct.unpack("<Q", _read(f, 8))
        f.seek(m, os.SEEK_CUR)
    return None


def read_gguf_header(path: str, where: str, *, string_arrays: bool = False) -> dict:
    """The metadata key/values of a GGUF file (not its tensors); UserError when it is missing or not GGUF. Long
    arrays are skipped (None) unless string_arrays=True reads those of strings (the tokenizer's tokens)."""
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
                meta[key] = _value(f, vtype, strings=string_arrays)
    except UserError:
        raise
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: {path!r} is a corrupt or unsupported GGUF file ({exc})") from None
    if "general.architecture" not in meta:
        raise UserError(f"{where}: {path!r} is a GGUF file without general.architecture")
    return meta
