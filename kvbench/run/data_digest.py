"""The identity of the data a run reads: a digest of the bytes of every local data file its task names.

    data_sha256(task_options) -> "<64 hex>" or None
    method_files_sha256(method_options) -> "<64 hex>" or None
    model_files_sha256(model_options) -> "<64 hex>" or None     the model's config, tokenizer and weights
    method_source_sha256([method name, ...]) -> "<64 hex>" or None     the method's own source files

The run id covers the config; a file named in the config (`task.text_file`, `task.data_path`, `task.data_dir`) can
change at the same path, so its content is hashed too (kvbench.run.spec.hashable_config adds the digest as
`data_sha256`): an edited file is a new run, never "already finished; skipping" with the old result. The digest is
also recorded in config.yaml and metrics.json (`data_sha256`), so pandas and kvbench-compare tell two versions of
the data apart.

- a file: sha256 over its bytes; a folder (or a zip, hashed as a file): every regular file under it, in sorted
  relative-path order, each as its path, size and sha256 (hidden files and folders, such as `.cache/`, skipped: the
  loaders list folders with `visible_files`, which skips the same names, so a file they read is a file hashed);
- several options naming files: one digest over all of them, each under its option name;
- values that name no local file (null, `kvbench:smoke`, a hub id, a path that does not exist) add nothing: the
  task's preflight refuses a missing path; packaged data is identified by its package's version (recorded with
  the versions in metrics.json, kvbench.run.app.versions), not hashed into the run id, like the code's own version.

Each file's digest is cached for the process, keyed by its path, inode, size and modification time, so the several
places that name a run (Hydra's run folder, the plan) read each file once.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

from kvbench import atomic_write
from kvbench.registry import METHODS, source_file  # the methods load on first lookup, by name

# The task options that name local data files, in the order they are hashed.
DATA_FILE_OPTIONS = ("text_file", "data_path", "data_dir")
_CHUNK = 1 << 20
_file_cache: dict[tuple, str] = {}


def file_sha256(path: str) -> str:
    """sha256 (hex) of a regular file's bytes, cached by (real path, inode, size, mtime_ns)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _file_cache.get(key)
    if cached is not None:
        return cached
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            h.update(chunk)
    digest = h.hexdigest()
    _file_cache[key] = digest
    return digest


def _folder_files(root: str) -> list[str]:
    """Regular files under root (relative paths, sorted), hidden names skipped, symlinked folders not followed."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            full = os.path.join(folder, name)
            if not name.startswith(".") and os.path.isfile(full):
                out.append(os.path.relpath(full, root))
    return sorted(out)


def visible_files(root: Any, suffixes: tuple[str, ...]) -> list:
    """The files under the folder `root` (a pathlib.Path) whose suffix is in `suffixes` (lowercase compare), sorted,
    hidden files and folders skipped: the data loaders list a folder with this, so that every file they read is one
    the digest covers (`path_sha256` skips the same hidden names)."""
    root = Path(root)
    return [root / rel for rel in _folder_files(str(root)) if Path(rel).suffix.lower() in suffixes]


def path_sha256(path: str) -> Optional[str]:
    """The digest of one local data path (a file's bytes, or a folder's files), or None if it is neither."""
    local = os.path.expanduser(path)
    if os.path.isfile(local):
        return file_sha256(local)
    if os.path.isdir(local):
        h = hashlib.sha256()
        for rel in _folder_files(local):
            full = os.path.join(local, rel)
            h.update(f"{rel}\0{os.path.getsize(full)}\0{file_sha256(full)}\n".encode())
        return h.hexdigest()
    return None


def data_sha256(task: Any) -> Optional[str]:
    """One digest over the local data files the task options name (DATA_FILE_OPTIONS), or None when they name
    none. Never raises: a path that cannot be read is left to the task's preflight to refuse."""
    if not isinstance(task, dict):
        return None
    named = [(option, task.get(option)) for option in DATA_FILE_OPTIONS]
    parts = _digest_parts([(option, value) for option, value in named
                           if isinstance(value, str) and value.strip() and not value.startswith("kvbench:")])
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0].split("=", 1)[1]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _digest_parts(named: list[tuple[str, str]]) -> list[str]:
    """"option=digest" of each (option, path) whose path can be read (path_sha256 not None); the others are left
    out (a path that cannot be read is the preflight's to refuse)."""
    parts = []
    for option, value in named:
        try:
            digest = path_sha256(value)
        except (OSError, ValueError):
            digest = None
        if digest is not None:
            parts.append(f"{option}={digest}")
    return parts


def _path_options(options: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted option, value) of every option named `path` or `*_path` in a method's options, nested ones too
    (a wrapper's base_options)."""
    out = []
    for key, value in (options.items() if isinstance(options, dict) else ()):
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _path_options(value, f"{name}.")
        elif isinstance(value, str) and (key == "path" or str(key).endswith("_path")):
            out.append((name, value))
    return sorted(out)


def method_files_sha256(method: Any) -> Optional[str]:
    """One digest over the local files a method's options name (`path`, `*_path`: KVzap's surrogate folder,
    DuoAttention's patterns), or None when they name none (hub ids and missing paths add nothing). Like the data
    files, a surrogate edited at the same path is another run."""
    parts = _digest_parts(_path_options(method))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest() if parts else None


# --------------------------------------------------------------------------- the model's files
# Files of a model folder that the loader does not read (documentation, pictures): an edited README is the same model.
MODEL_DOC_SUFFIXES = (".md", ".png", ".jpg", ".jpeg", ".gif", ".pdf")
MODEL_DOC_PREFIXES = ("LICENSE", "NOTICE", "USE_POLICY")
DIGEST_INDEX = "digests.json"  # in $KVBENCH_CACHE_DIR (~/.cache/kvbench): file digests by path, size and mtime
_index: Optional[dict] = None


def _digest_index_path() -> str:
    root = os.environ.get("KVBENCH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvbench")
    return os.path.join(root, DIGEST_INDEX)


def stored_file_sha256(path: str) -> str:
    """file_sha256, remembered across processes in $KVBENCH_CACHE_DIR/digests.json keyed by (real path, size,
    mtime_ns): a model's weights (gigabytes) are hashed once, then read back by every later run."""
    global _index
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    index_path = _digest_index_path()
    if _index is None:
        try:
            with open(index_path, encoding="utf-8") as f:
                _index = json.load(f)
        except (OSError, ValueError):
            _index = {}
        if not isinstance(_index, dict):
            _index = {}
    if isinstance(_index.get(key), str):
        return _index[key]
    digest = file_sha256(path)
    try:  # re-read and merge: another process may have added entries meanwhile
        with open(index_path, encoding="utf-8") as f:
            on_disk = json.load(f)
        _index = {**on_disk, **_index} if isinstance(on_disk, dict) else _index
    except (OSError, ValueError):
        pass
    _index[key] = digest
    try:
        atomic_write.write_text(index_path, json.dumps(_index, indent=0))
    except OSError:  # a read-only cache still works: the file is hashed again next process
        pass
    return digest


def _model_folder_files(folder: str) -> list[str]:
    """The files of a model folder the loader may read: its visible top-level files (config, tokenizer, weights,
    generation config), documentation left out; sub-folders (a hub repo's `original/` checkpoint) are not read."""
    out = []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if (name.startswith(".") or not os.path.isfile(full) or name.lower().endswith(MODEL_DOC_SUFFIXES)
                or name.upper().startswith(MODEL_DOC_PREFIXES)):
            continue
        out.append(name)
    return out


def _hub_snapshot(repo_id: str) -> Optional[str]:
    """The local Hugging Face cache's snapshot folder of a hub model (the `main` ref), or None when not cached.
    Nothing is fetched."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return os.path.dirname(found) if isinstance(found, str) else None


def model_files_sha256(model: Any) -> Optional[str]:
    """One digest over the files the model section's `path` (and `gguf_file`) name: a local folder's config,
    tokenizer and weights, a .gguf file, or a cached hub model's snapshot (its files by their blob names, which are
    their hashes: nothing is read). None for the packaged model (identified by its package's version), a hub id not
    cached yet, or a path that does not exist (refused by the plan). An edited config.json, tokenizer or weight file
    at the same path is another run."""
    if not isinstance(model, dict) or not isinstance(model.get("path"), str) or not model["path"].strip():
        return None
    path, gguf = os.path.expanduser(model["path"]), model.get("gguf_file")
    h = hashlib.sha256()
    try:
        if os.path.isfile(path):
            return stored_file_sha256(path)
        if os.path.isdir(path):
            if isinstance(gguf, str) and gguf:
                return stored_file_sha256(os.path.join(path, gguf))
            for name in _model_folder_files(path):
                full = os.path.join(path, name)
                h.update(f"{name}\0{os.path.getsize(full)}\0{stored_file_sha256(full)}\n".encode())
            return h.hexdigest()
        snapshot = _hub_snapshot(model["path"])
        if snapshot is None:
            return None
        for name in _model_folder_files(snapshot):
            full = os.path.join(snapshot, name)
            h.update(f"{name}\0{os.path.getsize(full)}\0{os.path.basename(os.path.realpath(full))}\n".encode())
        return h.hexdigest()
    except (OSError, ValueError):
        return None  # unreadable: the plan's model checks refuse it


# --------------------------------------------------------------------------- the method's source
def method_source_sha256(names: list) -> Optional[str]:
    """One digest over the source files of the registered methods `names` (the run's method and a wrapper's base):
    each class's own file and those of its base classes outside the runtime and the standard library, so a user's
    method file (or a built-in's) edited at the same path is another run. None when no name is registered."""
    files: list[str] = []
    for name in names:
        try:
            cls = METHODS.get(name)
        except Exception:
            continue
        for klass in getattr(cls, "__mro__", ()):
            top = str(getattr(klass, "__module__", "")).split(".")[0]
            if top == "builtins" or top in sys.stdlib_module_names or klass.__module__.startswith("kvbench.runtime"):
                continue
            file = source_file(klass)
            if os.path.isfile(file) and file not in files:
                files.append(file)
    if not files:
        return None
    h = hashlib.sha256()
    for file in files:  # by file name (not the full path: a checkout moved elsewhere is the same code)
        h.update(f"{os.path.basename(file)}\0{file_sha256(file)}\n".encode())
    return h.hexdigest()
