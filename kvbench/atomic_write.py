"""Files and folders that a kill never leaves half-written: written under a temporary name in the target's own
folder, then moved over the target with os.replace (atomic within one filesystem); the temporary is removed on any
failure, so readers see the old target or the new one, never a part.

    with replaced(path) as tmp:          # write the file tmp (any way: open, torch.save, a compiler's -o)
        ...                              # clean exit: tmp becomes path; exception: tmp is removed, path untouched
    with replaced(path, folder=True) as tmp:   # tmp: a path to create a folder at; an old folder at path is
        ...                                    # removed just before the new one takes its place
    write_text(path, text, fsync=True)   # the common case

The one place the temp-then-rename pattern lives (the results store, the calibration and digest caches, the CPU
kernels' build, the GGUF conversion, the speed log). The bottom layer: imports no kvbench module.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator, Optional

_UMASK = os.umask(0o022)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # what open() would give a new file under this process's umask


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replaced(path: str | os.PathLike, *, folder: bool = False, mode: Optional[int] = None,
             fsync: bool = False) -> Iterator[str]:
    """Yield a temporary path beside `path` for the caller to fill: an empty file, or with folder=True a path where
    the caller creates the folder (inside a private folder of this writer's, so it does not exist yet). On a clean
    exit the file gets `mode` (default: what open() would give under the umask; mkstemp's 0600 is never kept by
    accident; a folder keeps the mode it was made with unless `mode` is given), is fsynced when `fsync` (files
    only) and os.replace'd over `path`. On any exception (os.replace's included) the temporary is removed and the
    exception goes on. Names are unique (mkstemp / mkdtemp), so concurrent writers never share one; they start
    with "." and end with ".tmp" so a folder listing can tell them apart."""
    target = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    prefix, suffix = "." + os.path.basename(target) + ".", ".tmp"
    if folder:
        holder = tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent)  # private (0700), this writer's own
        tmp = os.path.join(holder, os.path.basename(target))
    else:
        fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=parent)
        os.close(fd)
        holder = tmp
    try:
        yield tmp
        if mode is not None or not folder:
            os.chmod(tmp, mode if mode is not None else FILE_MODE)
        if fsync and not folder:
            _fsync_file(tmp)
        if folder and os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)  # os.replace cannot move a folder over a non-empty one
        os.replace(tmp, target)
        if folder:
            os.rmdir(holder)
    except BaseException:
        _remove(holder)
        raise


def write_text(path: str | os.PathLike, text: str, *, fsync: bool = False, mode: Optional[int] = None) -> None:
    """Write `text` (UTF-8) to `path` atomically (see replaced)."""
    with replaced(path, fsync=fsync, mode=mode) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
