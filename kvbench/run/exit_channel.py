"""The exit channel: how every run of one CLI process, and of its launcher workers, reports its exit code and run
folder to the CLI process, which exits with the worst code and prints the sweep's table (kvbench.run.sweep_table).

    open_exit_channel()          in the CLI process, before Hydra launches anything
    note_exit(code, run_dir)     after each run (kvbench.commands.hydra_task.main), in whichever process ran it
    exit_code(), sweep_runs()    in the CLI process, at the end
    close_exit_channel()
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

_exit_code = 0
# Launcher workers (joblib, submitit) run in other processes: they report each run's exit code and folder through
# a channel the CLI process opens (open_exit_channel) and reads at the end (exit_code, sweep_runs).
EXIT_FILE_ENV = "KVBENCH_EXIT_FILE"
_STALE_PREFIX = "kvbench-exit-"  # named channel files (only where there is no O_TMPFILE): kvbench-exit-<pid>-*
_channel_fd: Optional[int] = None


def _merge(a: int, b: int) -> int:
    return 2 if 2 in (a, b) else max(a, b)


def open_exit_channel() -> None:
    """In the CLI process, before Hydra launches anything: a file where every worker process notes its runs.

    On Linux the file has no name (O_TMPFILE): workers open it as /proc/<pid>/fd/<fd>, and it vanishes with the
    process, however it ends (kill -9 included). Elsewhere it is a named temp file, deleted at the end; files of
    processes that no longer exist (killed before they could delete theirs) are deleted when the next one opens."""
    global _channel_fd
    if os.environ.get(EXIT_FILE_ENV):
        return
    try:
        fd = os.open(tempfile.gettempdir(), os.O_TMPFILE | os.O_RDWR, 0o600)
        path = f"/proc/{os.getpid()}/fd/{fd}"
        if not os.path.exists(path):
            os.close(fd)
            raise OSError("no /proc")
        _channel_fd = fd
    except (AttributeError, OSError):
        _remove_stale_channels()
        fd, path = tempfile.mkstemp(prefix=f"{_STALE_PREFIX}{os.getpid()}-")
        os.close(fd)
    os.environ[EXIT_FILE_ENV] = path


def _remove_stale_channels() -> None:
    """Delete this user's named channel files whose process is gone."""
    import glob

    for path in glob.glob(os.path.join(tempfile.gettempdir(), _STALE_PREFIX + "*")):
        pid = os.path.basename(path)[len(_STALE_PREFIX):].split("-")[0]
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except OSError:
            continue


def _channel_lines() -> list:
    """(code, run folder or None) for each line the runs of this process and its workers wrote."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path:
        return []
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        code, _, run_dir = line.partition("\t")
        if code.strip().isdigit():
            out.append((int(code), run_dir or None))
    return out


def exit_code() -> int:
    """0 if every run (of this process and its launcher workers) succeeded; 2 if one had bad input; else 1."""
    code = _exit_code
    for c, _ in _channel_lines():
        code = _merge(code, c)
    return code


def sweep_runs() -> list:
    """The run folders this CLI process and its launcher workers finished or skipped, in the order reported."""
    return list(dict.fromkeys(d for _, d in _channel_lines() if d))


def close_exit_channel() -> None:
    """At the end of the CLI process: close (and, when it has a name, delete) the channel."""
    global _channel_fd
    path = os.environ.pop(EXIT_FILE_ENV, None)
    if _channel_fd is not None:
        os.close(_channel_fd)
        _channel_fd = None
    elif path:
        try:
            os.unlink(path)
        except OSError:
            pass


def note_exit(code: int, run_dir: Optional[str] = None) -> None:
    """Note a run's exit code, and its folder when it finished or was skipped, for the CLI process's end."""
    global _exit_code
    _exit_code = _merge(_exit_code, code)
    path = os.environ.get(EXIT_FILE_ENV)
    if path and (code or run_dir):
        try:
            with open(path, "a") as f:
                f.write(f"{code}\t{run_dir or ''}\n")
        except OSError:
            pass
