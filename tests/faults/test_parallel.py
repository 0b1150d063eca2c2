"""Two identical sweeps started together into one results folder split the work: each run is done and indexed
exactly once (a run is claimed before it starts). A claim left by a dead worker is taken over."""
from __future__ import annotations

import fcntl
import errno
import json
import os
import socket
import time

from tests import fault_cli
from kvbench.store.claims import CLAIM_OWNER_FILE, CLAIM_STALE_S, claim_run
from kvbench.store.files import read_jsonl
from kvbench.store.folder import RunFolder, repair_index


def test_two_sweeps_at_once_do_each_run_once(tmp_path):
    out = tmp_path / "r"
    sweep = ["-m", "budget=8,16,24,32", f"results_dir={out}"]
    procs = [fault_cli.start(*sweep, cwd=tmp_path, sleep_before_task=1.5) for _ in range(2)]
    outputs = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, outputs):
        assert p.returncode == 0, e
    runs = read_jsonl(str(out / "runs.jsonl"))
    assert sorted(r["budget"] for r in runs) == [8, 16, 24, 32], runs  # each once, none twice
    assert {r["status"] for r in runs} == {"ok"}
    workers = {r["pid"] for r in runs}
    said = "".join(o for o, _ in outputs)
    assert "is being run by pid" in said or "already finished" in said or len(workers) == 1


def _no_flock(monkeypatch):
    def flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks on this filesystem")

    monkeypatch.setattr(fcntl, "flock", flock)


def _owner(run_dir, **info):
    path = run_dir / CLAIM_OWNER_FILE
    path.write_text(json.dumps(info))
    return path


def test_claims_without_flock_take_over_dead_workers(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    host = socket.gethostname()

    _owner(run_dir, host=host, pid=os.getpid(), nonce="live")  # a live worker on this host: respected
    claim, holder = claim_run(str(run_dir))
    assert claim is None and holder["nonce"] == "live"

    dead_pid = 2**22 + 12345  # above the kernel's pid_max default: never a live process
    _owner(run_dir, host=host, pid=dead_pid, nonce="dead")  # its pid is gone: taken over
    claim, holder = claim_run(str(run_dir))
    assert claim is not None and holder is None
    claim.release()
    assert not (run_dir / CLAIM_OWNER_FILE).exists()

    path = _owner(run_dir, host="elsewhere", pid=1, nonce="far")  # another host, fresh heartbeat: respected
    assert claim_run(str(run_dir))[0] is None
    old = time.time() - CLAIM_STALE_S - 5
    os.utime(path, (old, old))  # its heartbeat stopped: taken over
    claim, _ = claim_run(str(run_dir))
    assert claim is not None
    claim.release()


def test_flock_claim_is_exclusive_and_released(tmp_path):
    run_dir = str(tmp_path / "run")
    first, _ = claim_run(run_dir)
    second, holder = claim_run(run_dir)  # a second open file: the lock is held
    assert first is not None and second is None and holder["pid"] == os.getpid()
    first.release()
    third, _ = claim_run(run_dir)
    assert third is not None
    third.release()


def test_repairs_racing_finishing_runs_never_duplicate(tmp_path):
    import threading

    def finish(i):
        folder = RunFolder(str(tmp_path), f"run{i}")
        folder.start("a: 1\n")
        folder.finish({"run_id": f"run{i}", "status": "ok", "attempt_id": f"a{i}"})

    stop = threading.Event()

    def repair():
        while not stop.is_set():
            repair_index(str(tmp_path))

    repairer = threading.Thread(target=repair)
    repairer.start()
    workers = [threading.Thread(target=finish, args=(i,)) for i in range(24)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    repairer.join()
    ids = [r["attempt_id"] for r in read_jsonl(str(tmp_path / "runs.jsonl"))]
    assert sorted(ids) == sorted(f"a{i}" for i in range(24))
