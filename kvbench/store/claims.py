"""A worker's claim on one run, so that parallel or repeated sweeps into one results folder split the work.

    claim, holder = claim_run(run_dir)    # (Claim, None), or (None, the live holder's info)
    ...                                   # run it
    claim.release()

The claim is an exclusive flock on run_dir/.claim held by an open fd: the kernel (or NFS lock manager) drops it when
the worker dies, so a dead worker's run is simply claimed again. Where the filesystem has no flock, the claim is
run_dir/.claim.owner created with O_EXCL (pid, host, nonce); a heartbeat thread refreshes its mtime, and it is taken
over when its pid is gone on this host or its heartbeat is older than CLAIM_STALE_S (KVBENCH_CLAIM_STALE_S).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
import time
from typing import Optional

from kvbench.store.files import NO_LOCK_ERRNOS, write_all

CLAIM_FILE = ".claim"
CLAIM_OWNER_FILE = ".claim.owner"  # used only where the filesystem has no flock
CLAIM_HEARTBEAT_S = 30.0
CLAIM_STALE_S = float(os.environ.get("KVBENCH_CLAIM_STALE_S", "600"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_is_dead(info: dict, mtime: float, now: Optional[float] = None) -> bool:
    """A claim (for filesystems without flock) is dead when its pid is gone on this host, or its heartbeat (the
    file's mtime, refreshed every CLAIM_HEARTBEAT_S) is older than CLAIM_STALE_S."""
    now = time.time() if now is None else now
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        if not _pid_alive(info["pid"]):
            return True
    return now - mtime > CLAIM_STALE_S


class Claim:
    """This worker's claim on one run, held until release(); a daemon thread beats its heartbeat meanwhile."""

    def __init__(self, path: str, fd: Optional[int], nonce: str):
        self.path, self.fd, self.nonce = path, fd, nonce
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvbench-claim-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        # SIGINT/SIGTERM go to the main thread, whose blocking call (a sleep, a read) they interrupt
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        while not self._stop.wait(CLAIM_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Give the run up: the lock is dropped (flock) or the owner file removed, if it is still ours."""
        self._stop.set()
        if self.fd is not None:  # flock mode: the file stays (unlinking it would let two workers lock two inodes)
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        else:
            if (_read_claim(self.path) or {}).get("nonce") == self.nonce:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass


def _read_claim(path: str) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8") or "{}")
    except (OSError, ValueError):
        return None


def _claim_info(nonce: str) -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "nonce": nonce,
                       "claimed_at": time.time()}).encode()


def claim_run(run_dir: str) -> tuple[Optional[Claim], Optional[dict]]:
    """Claim the run in run_dir: (Claim, None), or (None, holder info) when a live worker holds it."""
    os.makedirs(run_dir, exist_ok=True)
    nonce = os.urandom(8).hex()
    path = os.path.join(run_dir, CLAIM_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, _read_claim(path) or {}
    except OSError as exc:
        os.close(fd)
        if exc.errno not in NO_LOCK_ERRNOS:
            raise
        return _claim_without_locks(run_dir, nonce)
    os.ftruncate(fd, 0)
    os.pwrite(fd, _claim_info(nonce), 0)
    return Claim(path, fd, nonce), None


def _claim_without_locks(run_dir: str, nonce: str) -> tuple[Optional[Claim], Optional[dict]]:
    path = os.path.join(run_dir, CLAIM_OWNER_FILE)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = _read_claim(path) or {}
            try:
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            if not claim_is_dead(info, mtime):
                return None, info
            try:  # a dead worker's claim: take it over
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue
        try:
            write_all(fd, _claim_info(nonce))
        finally:
            os.close(fd)
        return Claim(path, None, nonce), None
    return None, _read_claim(path) or {}
