"""The line printed before a run starts: what it will compute, and about how long that takes on this machine.

    plan_line(task_name, workload, speed) -> str   the line (workload from task.workload(settings))
    measured_speed(model, dtype, device) -> dict   the rates last measured here for that model (or None)
    record_speed(record)                            after a finished run: keep its measured rates

The time is rough: prompt tokens / prefill tok/s + generated tokens / decode tok/s, at the rates the last finished
run of the same model, dtype and device measured on this machine (kept in `speed.json` in kvbench's cache folder,
with the date and the run), never a figure written into the code. Before any run measured them the line says so.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

SPEED_FILE = "speed.json"
RATES = ("prefill_tokens_per_s", "decode_tokens_per_s")


def _speed_path() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE_DIR") or Path.home() / ".cache" / "kvbench") / SPEED_FILE


def _key(model: Any, dtype: Any, device: Any) -> str:
    return f"{model}|{dtype}|{device}"


def _read_all() -> dict:
    try:
        data = json.loads(_speed_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_speed(model: Any, dtype: Any, device: Any) -> Optional[dict]:
    """{prefill_tokens_per_s, decode_tokens_per_s, measured_at, run_id} last measured here for this model, dtype
    and device (either rate may be missing), or None."""
    entry = _read_all().get(_key(model, dtype, device))
    return entry if isinstance(entry, dict) else None


def record_speed(record: dict) -> None:
    """Keep a finished run's measured rates for the next run's estimate (each rate only when the run measured it;
    written atomically; a failure to write is ignored: the estimate is a courtesy)."""
    if record.get("status") != "ok":
        return
    rates = {k: float(record[k]) for k in RATES
             if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool) and record[k] > 0}
    if not rates:
        return
    path = _speed_path()
    try:
        data = _read_all()
        key = _key(record.get("model"), record.get("dtype"), record.get("device"))
        entry = dict(data.get(key) or {})
        entry.update(rates, measured_at=_dt.date.today().isoformat(), run_id=record.get("run_id"))
        data[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".speed-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass


def _tokens(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.0f}k"
    return f"{n:,}"


def duration(seconds: float) -> str:
    """"40 s", "12 min", "3.4 h", "2.1 days"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def estimate_seconds(workload: Any, speed: Optional[dict]) -> Optional[float]:
    """prompt tokens / prefill rate + generated tokens / decode rate; None when a needed rate was never measured."""
    if not speed:
        return None
    total = 0.0
    for tokens, rate in ((workload.prompt_tokens, speed.get("prefill_tokens_per_s")),
                         (workload.new_tokens, speed.get("decode_tokens_per_s"))):
        if tokens:
            if not rate:
                return None
            total += tokens / rate
    return total


def plan_line(task_name: str, workload: Any, speed: Optional[dict]) -> str:
    """One line: the work, the estimate at this machine's measured rates (or that none was measured yet), and the
    options that shorten it."""
    bound = "" if workload.exact else "up to "
    work = (f"kvbench: {task_name}: {workload.what} = {workload.prompts:,} prompt(s), {bound}"
            f"{_tokens(workload.prompt_tokens)} prompt tokens")
    if workload.new_tokens:
        work += f" and up to {_tokens(workload.new_tokens)} generated"
    seconds = estimate_seconds(workload, speed)
    if seconds is None:
        when = "; no speed measured on this machine for this model yet (this run measures it)"
    else:
        rates = " and ".join(f"{speed[k]:,.1f} {k.split('_')[0]}" for k in RATES if speed.get(k))
        when = (f"; about {duration(seconds)} here (at {rates} tok/s, measured on this machine "
                f"{speed.get('measured_at', '?')})")
    return f"{work}{when}; shorten with {workload.shorten}"
