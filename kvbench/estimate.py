"""The line printed before a run starts: what it will compute, and about how long the run takes on this machine.

    plan_line(task_name, workload, speed, model_loaded=False) -> str   the line (workload: task.workload(settings))
    estimate_seconds(workload, speed, model_loaded=False) -> seconds   from the line to the run's end, or None
    measured_speed(model, dtype, device, threads) -> dict               the medians of this machine's recent runs
    record_speed(record, threads)                                       after a finished run: keep its figures
    process_age_s()                                                     seconds since this process started

The time covers the whole run from the line on: the logger's start, the model's load (unless this process holds it
already: a sweep loads it once), prompt tokens / prefill tok/s + generated tokens / decode tok/s, and the task's own
work besides (data, tokenizing, scoring, writing: `overhead_s`, what a finished run took beyond those, per task).
Every figure is the median of the recent runs (at most KEEP) of the same model, dtype, device, thread setting and
CPU kind on this machine (`speed.json` in kvbench's cache folder, each run with its date and id), never a figure
written into the code and never the last run's alone: one run slowed by a competing process moves the median little.
Before any run measured them the line says so.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any, Optional

from kvbench import atomic_write

SPEED_FILE = "speed.json"
RATES = ("prefill_tokens_per_s", "decode_tokens_per_s")
FIXED = ("load_s", "logger_start_s")  # a run's fixed costs besides its tokens
KEEP = 7  # recent runs kept per (model, dtype, device, threads, CPU kind)


def _speed_path() -> Path:
    return Path(os.environ.get("KVBENCH_CACHE_DIR") or Path.home() / ".cache" / "kvbench") / SPEED_FILE


def cpu_kind() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's processor or machine name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "?"


def _key(model: Any, dtype: Any, device: Any, threads: Any = None) -> str:
    return f"{model}|{dtype}|{device}|threads={threads or 'auto'}|{cpu_kind()}"


def _read_all() -> dict:
    try:
        data = json.loads(_speed_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _runs_of(entry: Any) -> list[dict]:
    if not isinstance(entry, dict):
        return []
    runs = entry.get("runs")
    return [r for r in runs if isinstance(r, dict)] if isinstance(runs, list) else []


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0


def measured_speed(model: Any, dtype: Any, device: Any, threads: Any = None) -> Optional[dict]:
    """The medians of the recent runs measured here for this model, dtype, device, thread setting and CPU kind:
    {prefill_tokens_per_s, decode_tokens_per_s, load_s, logger_start_s, overhead_s: {task: s}, runs, measured_at,
    run_id (the newest)}
    (a figure no run measured is missing), or None."""
    runs = _runs_of(_read_all().get(_key(model, dtype, device, threads)))
    if not runs:
        return None
    out: dict = {"runs": len(runs), "measured_at": max(str(r.get("measured_at", "?")) for r in runs),
                 "run_id": runs[-1].get("run_id")}  # the newest
    for name in RATES + FIXED:
        values = [float(r[name]) for r in runs if _positive(r.get(name)) and (name in FIXED or r[name] > 0)]
        if values:
            out[name] = statistics.median(values)
    overheads: dict = {}
    for r in runs:
        if _positive(r.get("overhead_s")) and r.get("task"):
            overheads.setdefault(str(r["task"]), []).append(float(r["overhead_s"]))
    out["overhead_s"] = {task: statistics.median(v) for task, v in overheads.items()}
    return out


def record_speed(record: dict, threads: Any = None, workload: Any = None) -> None:
    """Keep a finished run's figures for the next runs' estimates: its rates (each only when measured), its logger
    start, its model load (only when the model was loaded, not held from an earlier run of the process) and its
    overhead (wall time beyond those and its tokens at its own rates, given the workload). The newest KEEP runs per
    key stay; written atomically; a failure to write is ignored (the estimate is a courtesy)."""
    if record.get("status") != "ok":
        return
    run: dict = {k: float(record[k]) for k in RATES if _positive(record.get(k)) and record[k] > 0}
    if not run:
        return
    for name in FIXED:
        if _positive(record.get(name)) and not (name == "load_s" and record.get("model_cached")):
            run[name] = round(float(record[name]), 3)
    wall = record.get("wall_s")
    if workload is not None and _positive(wall):
        tokens = token_seconds(workload, run)
        if tokens is not None:
            fixed = sum(float(record[k]) for k in FIXED if _positive(record.get(k)))
            run["overhead_s"] = round(max(0.0, float(wall) - fixed - tokens), 3)
    run.update(task=record.get("task"), measured_at=_dt.date.today().isoformat(), run_id=record.get("run_id"))
    path = _speed_path()
    try:
        data = _read_all()
        key = _key(record.get("model"), record.get("dtype"), record.get("device"), threads)
        data[key] = {"runs": (_runs_of(data.get(key)) + [run])[-KEEP:]}
        atomic_write.write_text(path, json.dumps(data, indent=1, sort_keys=True), mode=0o600)  # this user's, as before
    except OSError:
        pass


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux: /proc), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # field 3 (state) on; field 22 is starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


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


def token_seconds(workload: Any, speed: Optional[dict]) -> Optional[float]:
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


def estimate_seconds(workload: Any, speed: Optional[dict], model_loaded: bool = False,
                     task: Optional[str] = None) -> Optional[float]:
    """The run from the line on: the logger's start, the model's load (model_loaded: held already), the tokens at
    the measured rates and the task's overhead (medians, measured_speed); None when a needed rate was never
    measured."""
    tokens = token_seconds(workload, speed)
    if tokens is None or speed is None:
        return None
    fixed = (0.0 if model_loaded else speed.get("load_s", 0.0)) + speed.get("logger_start_s", 0.0)
    return tokens + fixed + (speed.get("overhead_s") or {}).get(str(task), 0.0)


def plan_line(task_name: str, workload: Any, speed: Optional[dict], model_loaded: bool = False) -> str:
    """One line: the work, the estimate at this machine's measured figures (or that none was measured yet), and
    the options that shorten it."""
    bound = "" if workload.exact else "up to "
    work = (f"kvbench: {task_name}: {workload.what} = {workload.prompts:,} prompt(s), {bound}"
            f"{_tokens(workload.prompt_tokens)} prompt tokens")
    if workload.new_tokens:
        work += f" and up to {_tokens(workload.new_tokens)} generated"
    seconds = estimate_seconds(workload, speed, model_loaded, task_name)
    if seconds is None:
        when = "; no speed measured on this machine for this model yet (this run measures it)"
    else:
        rates = " and ".join(f"{speed[k]:,.1f} {k.split('_')[0]}" for k in RATES if speed.get(k))
        load = "" if model_loaded or "load_s" not in speed else f"model load {speed['load_s']:.0f} s, "
        runs = speed.get("runs", 1)
        when = (f"; about {duration(seconds)} here ({load}{rates} tok/s: the median of {runs} run"
                f"{'s' if runs != 1 else ''} measured on this machine, latest {speed.get('measured_at', '?')})")
    return f"{work}{when}; shorten with {workload.shorten}"
