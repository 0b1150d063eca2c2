"""One run's folder and the index over all of them (runs.jsonl).

    folder = RunFolder(results_dir, run_id)
    folder.start(config_yaml)         # clears an older result of this run id, writes config.yaml
    folder.write_samples(samples)
    folder.finish(record)             # metrics.json (last), then its runs.jsonl line, under the index's lock
    repair_index(results_dir)         # appends every finished folder the index lacks (a kill between the two)
"""
from __future__ import annotations

import fcntl
import math
import os
from typing import Optional

from kvbench.store import faults
from kvbench.store.claims import Claim, claim_run
from kvbench.store.files import (append_jsonl, append_locked, atomic_write_text, dumps, lock, parse_jsonl,
                                 read_json, write_json, write_jsonl)

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.yaml"
SAMPLES_FILE = "samples.jsonl"
ERROR_FILE = "error.txt"
RUNS_FILE = "runs.jsonl"

# Fields every metrics.json has (DESIGN.md); missing ones are written as null.
REQUIRED_FIELDS = (
    "run_id", "status", "error", "model", "method", "budget", "task",
    "prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s",
    "peak_kv_bytes", "full_kv_bytes", "kv_bytes_per_token",
    "wall_s", "num_samples", "device", "dtype",
    "kvbench", "torch", "transformers", "git_commit",
)


class IndexNotWritten(OSError):
    """The run's metrics.json is written (the folder is the truth: the run finished), only its runs.jsonl line is
    not (a full disk): the next run or load_runs adds it (repair_index). Never reported as a failed run."""


def finished_metrics(run_dir: str) -> Optional[dict]:
    """The metrics of a run that finished successfully in run_dir, else None."""
    data = read_json(os.path.join(run_dir, METRICS_FILE))
    if data and data.get("status") == "ok":
        return data
    return None


def complete_record(record: dict) -> dict:
    """Put every required field into the record (null when unknown), required fields first. JSON has no NaN/inf,
    so they are written as null and named in `nonfinite_metrics` ({"ppl": "inf", "nll": "nan"}): a null that
    stands for NaN or inf is not mistaken for a metric that was never measured."""
    out = {k: record.get(k) for k in REQUIRED_FIELDS}
    out.update({k: v for k, v in record.items() if k not in out})
    nonfinite = {k: str(v) for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)}
    if nonfinite:
        out["nonfinite_metrics"] = {**(out.get("nonfinite_metrics") or {}), **nonfinite}
    return out


def _attempt_key(rec: dict) -> str:
    return str(rec.get("attempt_id") or f"{rec.get('run_id')}@{rec.get('finished_at')}@{rec.get('status')}")


def run_folders(results_dir: str) -> list[str]:
    """The run folders of results_dir that hold a metrics.json (finished or failed attempts), sorted by name."""
    try:
        names = sorted(os.listdir(results_dir))
    except OSError:
        return []
    return [os.path.join(results_dir, n) for n in names
            if not n.startswith(".") and os.path.isfile(os.path.join(results_dir, n, METRICS_FILE))]


def repair_index(results_dir: str) -> int:
    """Append to runs.jsonl every finished folder's metrics.json whose attempt it lacks; returns how many.

    Runs under the index's flock, so two repairs (or a repair and an append) never duplicate a line."""
    path = os.path.join(results_dir, RUNS_FILE)
    folders = run_folders(results_dir)
    if not folders:
        return 0
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        lock(fd, fcntl.LOCK_EX)
        with open(path, "rb") as f:
            indexed = {_attempt_key(r) for r in parse_jsonl(f.read())[0]}
        missing = []
        for folder in folders:
            rec = read_json(os.path.join(folder, METRICS_FILE))
            if rec and rec.get("run_id") and _attempt_key(rec) not in indexed:
                missing.append((dumps(rec) + "\n").encode("utf-8"))
                indexed.add(_attempt_key(rec))
        if missing:
            append_locked(fd, path, missing)
        return len(missing)
    finally:
        os.close(fd)


class RunFolder:
    """One run's folder. start() clears the old result marker; finish() writes metrics.json last, then the index."""

    def __init__(self, results_dir: str, run_id: str, run_dir: Optional[str] = None):
        self.results_dir = os.path.abspath(results_dir)
        self.run_id = run_id
        self.path = os.path.abspath(run_dir or os.path.join(self.results_dir, run_id))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def finished(self) -> Optional[dict]:
        return finished_metrics(self.path)

    def failed_before(self) -> Optional[dict]:
        """The metrics of this run id's last attempt when it failed (status other than ok), else None."""
        data = read_json(self.file(METRICS_FILE))
        return data if data and data.get("status") != "ok" else None

    def claim(self) -> tuple[Optional[Claim], Optional[dict]]:
        return claim_run(self.path)

    def start(self, config_yaml: str) -> None:
        os.makedirs(self.path, exist_ok=True)
        # An older result of this run id (failed, or being rerun) stops counting the moment a new attempt starts.
        for name in (METRICS_FILE, SAMPLES_FILE, ERROR_FILE):
            try:
                os.unlink(self.file(name))
            except FileNotFoundError:
                pass
        atomic_write_text(self.file(CONFIG_FILE), config_yaml)

    def write_samples(self, samples: list[dict]) -> None:
        write_jsonl(self.file(SAMPLES_FILE), samples)

    def write_error(self, text: str) -> None:
        atomic_write_text(self.file(ERROR_FILE), text)

    def write_metrics(self, record: dict) -> dict:
        record = complete_record(record)
        write_json(self.file(METRICS_FILE), record)
        return record

    def index(self, record: dict) -> None:
        append_jsonl(os.path.join(self.results_dir, RUNS_FILE), record)

    def finish(self, record: dict) -> dict:
        """metrics.json, then its runs.jsonl line, both under the index's lock (so a concurrent repair_index never
        sees the folder finished but unindexed and adds the line twice). IndexNotWritten when only the line failed."""
        record = complete_record(record)
        path = os.path.join(self.results_dir, RUNS_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            write_json(self.file(METRICS_FILE), record)  # the folder is the truth; the index is repaired later
            raise IndexNotWritten(exc.errno, exc.strerror or str(exc), path) from exc
        try:
            lock(fd, fcntl.LOCK_EX)
            write_json(self.file(METRICS_FILE), record)
            faults.reach("before_index")
            try:
                append_locked(fd, path, [(dumps(record) + "\n").encode("utf-8")])
            except OSError as exc:
                raise IndexNotWritten(exc.errno, exc.strerror or str(exc), path) from exc
        finally:
            os.close(fd)
        return record
