"""Files of the results store that a kill never leaves half-written.

- atomic_write_text / write_json / write_jsonl: a temporary file in the same folder, fsync, os.replace.
- append_jsonl: one whole line under an exclusive flock, or nothing (a short write is taken back out and raised).
- read_json / read_jsonl: None / [] for what cannot be read; torn or corrupt JSONL lines are skipped and counted.
JSON has no NaN or inf: they are written as null.
"""
from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from typing import Any, Iterable, Optional

from kvbench import atomic_write
from kvbench.console import warn


# errno values meaning "this filesystem has no flock": the store then works without locks (see claims.claim_run).
NO_LOCK_ERRNOS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def atomic_write_text(path: str, text: str) -> None:
    """Write text to path through a temporary file in the same folder, fsync and os.replace (atomic_write)."""
    atomic_write.write_text(path, text, fsync=True)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def dumps(obj: Any, **kw: Any) -> str:
    """JSON text of obj: NaN and inf as null, numpy / torch scalars as numbers, anything else as its str."""
    return json.dumps(_clean(obj), default=_json_default, ensure_ascii=False, **kw)


def write_json(path: str, obj: Any) -> None:
    """Write obj as indented JSON, atomically."""
    atomic_write_text(path, dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    """Write the records as JSON lines, atomically."""
    atomic_write_text(path, "".join(dumps(r) + "\n" for r in records))


def lock(fd: int, kind: int) -> bool:
    """flock(fd, kind); False where the filesystem has no locks (the caller goes on without)."""
    try:
        fcntl.flock(fd, kind)
        return True
    except OSError as exc:
        if exc.errno in NO_LOCK_ERRNOS:
            return False
        raise


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written; a write of 0 bytes is an error."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def append_locked(fd: int, path: str, lines: list[bytes]) -> None:
    """Append whole lines to an fd opened with O_APPEND whose flock the caller holds; on any failure the file is
    cut back to its old size and OSError is raised (never a short record)."""
    size = os.fstat(fd).st_size
    data = b"".join(lines)
    if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line (killed writer): end it first
        data = b"\n" + data
    try:
        write_all(fd, data)
        os.fsync(fd)
    except OSError as exc:
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
        except OSError:
            pass
        raise OSError(exc.errno or errno.EIO, f"cannot append to {path}: {exc.strerror or exc}") from None


def append_jsonl(path: str, record: dict) -> None:
    """Append one line, whole or not at all (OSError); concurrent appenders are serialized by an flock."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (dumps(record) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        lock(fd, fcntl.LOCK_EX)
        append_locked(fd, path, [line])
    finally:
        os.close(fd)


def read_json(path: str) -> Optional[dict]:
    """The JSON object in path, or None when it is missing, unreadable, not JSON or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def parse_jsonl(data: bytes) -> tuple[list[dict], int]:
    """(records, number of torn or corrupt lines) of JSONL bytes; a line that is not valid UTF-8 JSON is skipped."""
    out, bad = [], 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8"))
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            out.append(rec)
        else:
            bad += 1
    return out, bad


def read_jsonl(path: str, *, quiet: bool = False) -> list[dict]:
    """Records of a JSONL file. Torn or corrupt lines (any encoding) are skipped with one warning that counts them."""
    try:
        with open(path, "rb") as f:
            lock(f.fileno(), fcntl.LOCK_SH)  # no half-appended line is read
            data = f.read()
    except OSError:
        return []
    out, bad = parse_jsonl(data)
    if bad and not quiet:
        warn(f"skipped {bad} torn or corrupt line(s) in {path}")
    return out
