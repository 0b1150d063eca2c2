"""The identity of the data a run reads: a digest of the bytes of every local data file its task names.

    data_sha256(task_options) -> "<64 hex>" or None
    method_files_sha256(method_options) -> "<64 hex>" or None

The run id covers the config; a file named in the config (`task.text_file`, `task.data_path`, `task.data_dir`) can
change at the same path, so its content is hashed too (kvbench.spec.hashable_config adds the digest as
`data_sha256`): an edited file is a new run, never "already finished; skipping" with the old result. The digest is
also recorded in config.yaml and metrics.json (`data_sha256`), so pandas and kvbench-compare tell two versions of
the data apart.

- a file: sha256 over its bytes; a folder (or a zip, hashed as a file): every regular file under it, in sorted
  relative-path order, each as its path, size and sha256 (hidden files and folders, such as `.cache/`, skipped);
- several options naming files: one digest over all of them, each under its option name;
- values that name no local file (null, `kvbench:smoke`, a hub id, a path that does not exist) add nothing: the
  task's preflight refuses a missing path; packaged data is identified by its package's version (recorded with
  the versions in metrics.json, kvbench.app.versions), not hashed into the run id, like the code's own version.

Each file's digest is cached for the process, keyed by its path, inode, size and modification time, so the several
places that name a run (Hydra's run folder, the plan) read each file once.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

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
