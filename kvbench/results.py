"""The results folder: one folder per run, written so that an interrupted run never looks finished.

results_dir/
  runs.jsonl                  one line per finished run (ok or failed), appended
  <run_id>/
    config.yaml               the resolved config
    samples.jsonl             one record per evaluated sample
    metrics.json              one flat object; written last, so its presence with status "ok" marks a finished run
    error.txt                 the traceback of a failed run
    .hydra/, kvbench.log      Hydra's own files (when run from the CLI)
    wandb/                    offline W&B run (when logging offline)

The run_id is derived from the config (model, method, task, runtime, budget, seed), so running the same config
again finds the finished run and skips it unless rerun=true. Every file is written to a temporary file in the same
folder and moved into place with os.replace (atomic on POSIX).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import tempfile
from typing import Any, Iterable, Optional

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

_UMASK = os.umask(0o022)
os.umask(_UMASK)

# Keys that do not change what a run computes, so they are left out of the config hash.
_UNHASHED = {"model": ("cache_dir",)}


def config_hash(hashable: dict) -> str:
    """A short stable hash of the parts of a config that determine the result."""
    data = copy.deepcopy(hashable)
    for section, keys in _UNHASHED.items():
        if isinstance(data.get(section), dict):
            for key in keys:
                data[section].pop(key, None)
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", str(value)).strip("-") or "x"


def run_id_for(hashable: dict) -> str:
    """`<model>_<task>_<method>_b<budget>_s<seed>_<hash>`: readable, and the same for the same config."""
    model = hashable.get("model") or {}
    name = model.get("name") or (os.path.basename(str(model.get("path") or "")) or "model")
    task = (hashable.get("task") or {}).get("name", "task")
    method = (hashable.get("method") or {}).get("name", "method")
    quant = (hashable.get("quant") or {}).get("name", "none")
    if quant not in ("none", "full", None):
        method = f"{method}+{quant}"
    budget = hashable.get("budget")
    parts = [_slug(name), _slug(task), _slug(method),
             "b" + ("none" if budget is None else _slug(budget)), "s" + _slug(hashable.get("seed", 0)),
             config_hash(hashable)]
    return "_".join(parts)


def atomic_write_text(path: str, text: str) -> None:
    """Write text to path through a temporary file in the same folder and os.replace."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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
    return json.dumps(_clean(obj), default=_json_default, ensure_ascii=False, **kw)


def write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, dumps(obj, indent=2, sort_keys=False) + "\n")


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(dumps(r) + "\n" for r in records))


def append_jsonl(path: str, record: dict) -> None:
    """Append one line with a single write (O_APPEND), so concurrent or interrupted appends keep lines whole."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    line = (dumps(record) + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line (killed writer): end it first
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def read_jsonl(path: str) -> list[dict]:
    """Records of a JSONL file; a torn or corrupt line is skipped."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
    except OSError:
        pass
    return out


def finished_metrics(run_dir: str) -> Optional[dict]:
    """The metrics of a run that finished successfully in run_dir, else None."""
    data = read_json(os.path.join(run_dir, METRICS_FILE))
    if data and data.get("status") == "ok":
        return data
    return None


def complete_record(record: dict) -> dict:
    """Put every required field into the record (null when unknown), required fields first."""
    out = {k: record.get(k) for k in REQUIRED_FIELDS}
    out.update({k: v for k, v in record.items() if k not in out})
    return out


class RunFolder:
    """One run's folder. start() clears the old result marker; finish() writes metrics.json last."""

    def __init__(self, results_dir: str, run_id: str, run_dir: Optional[str] = None):
        self.results_dir = os.path.abspath(results_dir)
        self.run_id = run_id
        self.path = os.path.abspath(run_dir or os.path.join(self.results_dir, run_id))

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def finished(self) -> Optional[dict]:
        return finished_metrics(self.path)

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

    def finish(self, record: dict) -> dict:
        record = complete_record(record)
        write_json(self.file(METRICS_FILE), record)
        append_jsonl(os.path.join(self.results_dir, RUNS_FILE), record)
        return record


def load_runs(results_dir: str, *, latest: bool = True) -> "Any":
    """A pandas DataFrame with one row per run in results_dir (from the run folders' metrics.json).

    With latest=False, one row per line of runs.jsonl instead (every attempt, including superseded ones)."""
    import pandas as pd

    if not latest:
        return pd.DataFrame(read_jsonl(os.path.join(results_dir, RUNS_FILE)))
    rows = []
    if os.path.isdir(results_dir):
        for name in sorted(os.listdir(results_dir)):
            rec = read_json(os.path.join(results_dir, name, METRICS_FILE))
            if rec is not None:
                rows.append(rec)
    return pd.DataFrame(rows)
