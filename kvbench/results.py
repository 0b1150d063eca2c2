"""The results folder: one folder per run (the truth) and an index over them (runs.jsonl).

results_dir/
  runs.jsonl                  one line per finished attempt (ok or failed); rebuilt from the folders if it lags
  <run_id>/
    .claim                    the claim of the worker running it (flock held for the run's duration)
    config.yaml               the resolved config
    samples.jsonl             one record per evaluated sample
    metrics.json              one flat object; written last, so its presence with status "ok" marks a finished run
    error.txt                 the traceback of a failed run
    .hydra/, kvbench.log      Hydra's own files (when run from the CLI)
    wandb/                    offline W&B run (when logging offline)

Guarantees (README "Results"):
- Every file but runs.jsonl is written to a temporary file and moved into place (os.replace), so a kill leaves the
  old file or the new one, never half of one. metrics.json is written last: a run without it did not finish.
- runs.jsonl lines are appended whole under an exclusive flock, or not at all (a short write on a full disk is
  taken back out and raised). Readers skip torn or undecodable lines and say how many.
- Each metrics.json carries an `attempt_id`; a finished folder whose attempt is missing from runs.jsonl (a kill
  between the two writes) is appended by `repair_index`, which the app runs once per process and load_runs runs too.
- A run is claimed before it starts (`claim_run`): parallel or repeated sweeps into one folder split the work, and
  the claim of a dead worker (its lock released by the kernel, or its pid gone / heartbeat stale) is taken over.

The run_id is derived from the config (model, method, task, runtime, budget, seed), so running the same config
again finds the finished run and skips it unless rerun=true.
"""
from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import socket
import tempfile
import threading
import time
from typing import Any, Iterable, Optional

from kvbench.console import say, warn

METRICS_FILE = "metrics.json"
CONFIG_FILE = "config.yaml"
SAMPLES_FILE = "samples.jsonl"
ERROR_FILE = "error.txt"
RUNS_FILE = "runs.jsonl"
CLAIM_FILE = ".claim"
CLAIM_OWNER_FILE = ".claim.owner"  # used only where the filesystem has no flock

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
_UNHASHED = {"model": ("cache_dir",), "runtime": ("threads",)}
# The packaged model's config name: with model.path set, the folder is named after the path instead.
PACKAGED_MODEL_NAME = "smollm2-135m"
# errno values meaning "this filesystem has no flock": the store then works without locks (see claim_run).
_NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
CLAIM_HEARTBEAT_S = 30.0
CLAIM_STALE_S = float(os.environ.get("KVBENCH_CLAIM_STALE_S", "600"))


# --------------------------------------------------------------------------- run ids
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


def model_label(model: dict) -> str:
    """The model's name in run ids: model.name, or the basename of model.path when a path replaces the
    packaged model (model.path=/x/Llama-3.2-1B under the default model config names the run Llama-3.2-1B)."""
    name, path = model.get("name"), model.get("path")
    if path and (not name or name == PACKAGED_MODEL_NAME):
        base = os.path.basename(os.path.normpath(str(path)))
        if model.get("gguf_file"):
            base = os.path.splitext(str(model["gguf_file"]))[0]
        return base or "model"
    return str(name or "model")


def run_id_for(hashable: dict) -> str:
    """`<model>_<task>_<method>_b<budget>_s<seed>_<hash>`: readable, and the same for the same config."""
    model = hashable.get("model") or {}
    task = (hashable.get("task") or {}).get("name", "task")
    method = (hashable.get("method") or {}).get("name", "method")
    quant = (hashable.get("quant") or {}).get("name", "none")
    if quant not in ("none", "full", None):
        method = f"{method}+{quant}"
    budget = hashable.get("budget")
    parts = [_slug(model_label(model)), _slug(task), _slug(method),
             "b" + ("none" if budget is None else _slug(budget)), "s" + _slug(hashable.get("seed", 0)),
             config_hash(hashable)]
    return "_".join(parts)


def experiment_key(hashable: dict) -> str:
    """A hash of everything that changes a result except the compression axes (method, quant, budget): the runs
    of one experiment share it, so a pivot over method and budget never mixes task, model or runtime settings."""
    rest = {k: v for k, v in hashable.items() if k not in ("method", "quant", "budget")}
    return config_hash(rest)


# --------------------------------------------------------------------------- files
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


def _lock(fd: int, kind: int) -> bool:
    """flock(fd, kind); False where the filesystem has no locks (the caller goes on without)."""
    try:
        fcntl.flock(fd, kind)
        return True
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return False
        raise


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written; a write of 0 bytes is an error."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


def _append_locked(fd: int, path: str, lines: list[bytes]) -> None:
    """Append whole lines to an fd opened with O_APPEND whose flock the caller holds; on any failure the file is
    cut back to its old size and OSError is raised (never a short record)."""
    size = os.fstat(fd).st_size
    data = b"".join(lines)
    if size and os.pread(fd, 1, size - 1) != b"\n":  # a torn last line (killed writer): end it first
        data = b"\n" + data
    try:
        _write_all(fd, data)
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
        _lock(fd, fcntl.LOCK_EX)
        _append_locked(fd, path, [line])
    finally:
        os.close(fd)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None


def _parse_lines(data: bytes) -> tuple[list[dict], int]:
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
            _lock(f.fileno(), fcntl.LOCK_SH)  # no half-appended line is read
            data = f.read()
    except OSError:
        return []
    out, bad = _parse_lines(data)
    if bad and not quiet:
        warn(f"skipped {bad} torn or corrupt line(s) in {path}")
    return out


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


# --------------------------------------------------------------------------- the index
def _attempt_key(rec: dict) -> str:
    return str(rec.get("attempt_id") or f"{rec.get('run_id')}@{rec.get('finished_at')}@{rec.get('status')}")


def _run_folders(results_dir: str) -> list[str]:
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
    folders = _run_folders(results_dir)
    if not folders:
        return 0
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _lock(fd, fcntl.LOCK_EX)
        with open(path, "rb") as f:
            indexed = {_attempt_key(r) for r in _parse_lines(f.read())[0]}
        missing = []
        for folder in folders:
            rec = read_json(os.path.join(folder, METRICS_FILE))
            if rec and rec.get("run_id") and _attempt_key(rec) not in indexed:
                missing.append((dumps(rec) + "\n").encode("utf-8"))
                indexed.add(_attempt_key(rec))
        if missing:
            _append_locked(fd, path, missing)
        return len(missing)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- claims
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
    """This worker's claim on one run, held until release(). See claim_run."""

    def __init__(self, path: str, fd: Optional[int], nonce: str):
        self.path, self.fd, self.nonce = path, fd, nonce
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="kvbench-claim-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(CLAIM_HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
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
    """Claim the run in run_dir: (Claim, None), or (None, holder info) when a live worker holds it.

    The claim is an exclusive flock on run_dir/.claim held by an open fd: the kernel (or NFS lock manager) drops it
    when the worker dies, so a dead worker's run is simply claimed again. Where the filesystem has no flock, the
    claim is run_dir/.claim.owner created with O_EXCL (pid, host; mtime = heartbeat) and taken over when dead."""
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
        if exc.errno not in _NO_LOCKS:
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
            _write_all(fd, _claim_info(nonce))
        finally:
            os.close(fd)
        return Claim(path, None, nonce), None
    return None, _read_claim(path) or {}


# --------------------------------------------------------------------------- one run's folder
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
        sees the folder finished but unindexed and adds the line twice)."""
        record = complete_record(record)
        path = os.path.join(self.results_dir, RUNS_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            write_json(self.file(METRICS_FILE), record)  # the folder is the truth; the index is repaired later
            raise
        try:
            _lock(fd, fcntl.LOCK_EX)
            write_json(self.file(METRICS_FILE), record)
            _append_locked(fd, path, [(dumps(record) + "\n").encode("utf-8")])
        finally:
            os.close(fd)
        return record


# --------------------------------------------------------------------------- pandas
def load_runs(results_dir: str, *, latest: bool = True, repair: bool = True) -> "Any":
    """A pandas DataFrame with one row per run in results_dir (from the run folders' metrics.json).

    With latest=False, one row per line of runs.jsonl instead (every attempt, including superseded ones). A run
    folder with an unreadable metrics.json is left out with a warning; with repair=True (default) the index first
    gets any finished attempt it lacks. Group rows with `group_columns(df)` or the `experiment_key` column."""
    import pandas as pd

    if repair:
        try:
            repair_index(results_dir)
        except OSError:
            pass  # a read-only results folder is still readable
    if not latest:
        return pd.DataFrame(read_jsonl(os.path.join(results_dir, RUNS_FILE)))
    rows, corrupt = [], []
    for folder in _run_folders(results_dir):
        rec = read_json(os.path.join(folder, METRICS_FILE))
        if rec is None:
            corrupt.append(os.path.basename(folder))
        else:
            rows.append(rec)
    if corrupt:
        warn(f"skipped {len(corrupt)} run folder(s) with a corrupt metrics.json in {results_dir}: "
             f"{', '.join(corrupt[:5])}{' ...' if len(corrupt) > 5 else ''}")
    return pd.DataFrame(rows)


SETTING_PREFIXES = ("model_", "task_", "runtime_", "method_", "quant_")
COMPRESSION_COLUMNS = ("method", "quant", "budget")


def group_columns(df: "Any", exclude: Iterable[str] = COMPRESSION_COLUMNS) -> list[str]:
    """The columns of load_runs() that describe a run's settings, except `exclude` (by default the compression
    axes: method, quant, budget and their method_* / quant_* options): group or pivot by these and each group is
    one experiment, e.g. `df.groupby(group_columns(df), dropna=False)`."""
    exclude = set(exclude)
    base = ["model", "task", "seed", "experiment", "dtype", "device"]
    cols = [c for c in base if c in df.columns and c not in exclude]
    for c in df.columns:
        if c.startswith(SETTING_PREFIXES) and c not in cols:
            axis = c.split("_", 1)[0]
            if axis in exclude or c in exclude:
                continue
            cols.append(c)
    return cols
