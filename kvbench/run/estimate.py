"""The line printed before a run starts: what it will compute, and about how long the run takes on this machine.

    plan_line(task_name, workload, speed, model_loaded=False) -> str   the line (workload: task.workload(settings))
    estimate_seconds(workload, speed, model_loaded=False) -> seconds   from the line to the run's end, or None
    measured_speed(model, dtype, device, threads, task=, method=, ...) -> dict   this machine's figures, now
    record_speed(record, threads, workload, ...)                       after a finished run: keep its figures
    sweep_line(estimates) -> str                                       a sweep's line: the sum of its jobs
    others_load() -> float                                             the tasks runnable now besides this one
    process_age_s()                                                    seconds since this process started

The time covers the whole run from the line on: the logger's start, the model's load (unless this process holds it
already: a sweep loads it once), prompt tokens / prefill tok/s + generated tokens / decode tok/s, and the task's own
work besides (data, tokenizing, scoring, writing: `overhead_s`, what a finished run took beyond those, per task).
Figures come from this machine's recent runs (`speed.json` in kvbench's cache folder, KEEP runs per model, dtype,
device, thread setting and CPU kind, each with its date, id, task, method, the load average of the other
processes while it ran and the CPU count), never from a figure written into the code:

- Load: a run beside busy processes is slower. Each run keeps the other processes' load (others_load: the tasks
  runnable now besides this one, sampled; not the 1-minute load average, which lags a minute behind); the estimate takes the runs measured at a like load (contention within
  SIMILAR of the one now), else the NEAREST runs in load, and scales each by the contention between the two loads,
  slowdown = max(1, (load + threads) / cpus) (threads: the torch threads the run uses; linear, so a floor: two
  threads beside many busy ones slow down faster, which is why like-load runs come first). A run measured under
  load no longer makes an idle machine's estimate 2-3x high.
- Method and task: a codec (kivi), a scoring pass or a method's own work change the rates. Runs of the same task
  and method are used first; else runs of the same task, then of the same method, then any, each times the
  factor between the two measured on this CPU's other models (1 where none was measured; the line says which).
- Generated tokens: a generation task names the most it may generate (max_new_tokens per prompt); most answers
  stop earlier. Each run keeps the share it generated (generated_fraction), and the estimate counts the median
  share of the runs of the same task and method, else of the same task (the most, where none ran).
- Fallbacks, so that every run gets an estimate once anything ran here: no decode rate measured for the model ->
  its prefill rate times the decode/prefill ratio of this CPU's other runs; no run of the model -> the runs of the
  model nearest in weight bytes, scaled by the bytes. Before any run measured anything the line says so.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from kvbench.runtime.model.model_files import gguf_location
from kvbench.runtime.model.packaged import packaged_smollm2

from kvbench import atomic_write

SPEED_FILE = "speed.json"
RATES = ("prefill_tokens_per_s", "decode_tokens_per_s")
FIXED = ("load_s", "logger_start_s")  # a run's fixed costs besides its tokens
KEEP = 16  # recent runs kept per (model, dtype, device, threads, CPU kind): enough to hold several loads
NEAREST = 3  # the runs nearest in load that an estimate takes the median of, when fewer ran at a like load
LOAD_FIELD = "others_runnable"  # a record's load (others_load); records of the 1-minute average count as unknown
RUNNABLE_SAMPLES = 25  # reads of the runnable count that others_load takes the median of (about 30 ms)
SIMILAR = 1.25  # runs whose contention is within this factor of the one now count as measured at a like load
# the attributes a run shares with the one estimated, best first: runs of the first tier that has the figure are used
TIERS = (("task", "method"), ("task",), ("method",), ())


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


def _split_key(key: str) -> Optional[tuple]:
    """(model, dtype, device, threads, cpu kind) of a record key, or None for an old key without threads."""
    parts = key.rsplit("|", 4)
    return tuple(parts) if len(parts) == 5 and parts[3].startswith("threads=") else None


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
    """A finite number >= 0 (not a bool, not NaN or infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _rate(run: dict, name: str) -> Optional[float]:
    value = run.get(name)
    return float(value) if _positive(value) and value > 0 else None


# ---------------------------------------------------------------------------------------------- load and contention
def others_load() -> Optional[float]:
    """How many other tasks want a CPU now: the median, over RUNNABLE_SAMPLES reads of /proc/stat's procs_running a
    millisecond apart, of the runnable tasks less this process's own. Not the 1-minute load average: that one lags by a
    minute, so a command started just after another finished reads about 1.5 busy processes on an idle machine
    (and an estimate 1.8x high), and one started beside a process that just began reads none. Where /proc/stat is
    unreadable: the 1-minute load average less this process's own part (its CPU seconds per second of its life,
    damped as the load average damps them). None where neither is known."""
    counts = []
    for _ in range(RUNNABLE_SAMPLES):
        try:
            with open("/proc/stat") as f:
                line = next((x for x in f if x.startswith("procs_running")), None)
            counts.append(max(0, int(line.split()[1]) - _own_runnable_threads()))
        except (OSError, ValueError, IndexError, AttributeError):
            break
        time.sleep(0.001)
    if len(counts) == RUNNABLE_SAMPLES:
        return float(statistics.median(counts))
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return None
    age = process_age_s()
    times = os.times()
    own = 0.0 if not age else (times.user + times.system) / age * (1.0 - math.exp(-age / 60.0))
    return round(max(0.0, load - own), 2)


def _own_runnable_threads() -> int:
    """This process's threads runnable now (the reader at least: a kernel pool's threads may still spin after a
    run's last step), from /proc/self/task/*/stat."""
    running = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                running += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(1, running)


def threads_used(threads: Any, cpus: Optional[int] = None) -> int:
    """The torch threads a run uses: its runtime.threads, else one per CPU."""
    cpus = cpus or os.cpu_count() or 1
    return int(threads) if isinstance(threads, int) and threads > 0 else cpus


def slowdown(load: Optional[float], cpus: Optional[int], threads: int) -> float:
    """How much slower a run of `threads` threads goes beside `load` other runnable processes on `cpus` CPUs than
    alone: max(1, (load + threads) / cpus) / max(1, threads / cpus) (1 where the load is unknown)."""
    if not _positive(load) or not cpus:
        return 1.0
    return max(1.0, (load + threads) / cpus) / max(1.0, threads / cpus)


# ---------------------------------------------------------------------------------------------- reading the records
def _matches(run: dict, target: dict, attrs: Iterable[str]) -> bool:
    """Whether the run shares these attributes with the target (one the target leaves unsaid always matches)."""
    return all(target.get(a) is None or run.get(a) == target.get(a) for a in attrs)


def _tier_runs(runs: list, target: dict, tier: tuple) -> list:
    """The runs of `tier`: sharing its attributes with the target, and not of a better tier."""
    exact = TIERS[0]
    if tier == exact:
        return [r for r in runs if _matches(r, target, exact)]
    return [r for r in runs if _matches(r, target, tier) and not _matches(r, target, exact)]


class _Now:
    """The load, CPU count and threads the estimate is for: scales each run's figures from its load to this one."""

    def __init__(self, load: Optional[float], cpus: int, threads: int):
        self.load, self.cpus, self.threads = load, cpus, threads
        self.slow = slowdown(load, cpus, threads)

    def factor(self, run: dict) -> float:
        """A run's seconds times this (its rates divided by it) are what they would be at the load now."""
        if not _positive(run.get(LOAD_FIELD)):
            return 1.0
        return self.slow / slowdown(run[LOAD_FIELD], run.get("cpus") or self.cpus, self.threads)

    def distance(self, run: dict) -> float:
        if not _positive(run.get(LOAD_FIELD)):
            return math.inf  # a run of before this load was kept: used only where no run has its load
        return abs(math.log(self.factor(run)))

    def nearest(self, runs: list, value: Callable[[dict], Optional[float]], rate: bool) -> Optional[tuple]:
        """(median, runs used) over the runs that have the figure and were measured at a load like the one now
        (contention within SIMILAR of it), else the NEAREST runs in load; each scaled to the load now."""
        have = [r for r in runs if value(r) is not None]
        if not have:
            return None
        known = sorted(d for d in map(self.distance, have) if d < math.inf)  # runs of unknown load: last resort
        reach = max(known[min(NEAREST, len(known)) - 1], math.log(SIMILAR)) if known else math.inf
        used = [r for r in have if self.distance(r) <= reach]
        figures = [value(r) / self.factor(r) if rate else value(r) * self.factor(r) for r in used]
        return statistics.median(figures), used


def _idle_median(runs: list, name: str, threads: int, cpus: int) -> Optional[float]:
    """The median of a figure over runs, each scaled to an idle machine (to compare figures across models)."""
    values = [_rate(r, name) * slowdown(r.get(LOAD_FIELD), r.get("cpus") or cpus, threads)
              for r in runs if _rate(r, name) is not None]
    return statistics.median(values) if values else None


def _tier_factor(data: dict, skip_key: str, target: dict, tier: tuple, name: str, cpus: int,
                 threads: int) -> Optional[float]:
    """rate(target's task and method) / rate(runs of `tier`), the median over this CPU's other models whose runs
    hold both; None where none does."""
    ratios = []
    for key, entry in data.items():
        parts = _split_key(key)
        if key == skip_key or parts is None or parts[4] != cpu_kind():
            continue
        runs = _runs_of(entry)
        exact = _idle_median(_tier_runs(runs, target, TIERS[0]), name, threads, cpus)
        other = _idle_median(_tier_runs(runs, target, tier), name, threads, cpus)
        if exact and other:
            ratios.append(exact / other)
    return statistics.median(ratios) if ratios else None


def _decode_per_prefill(data: dict, model: Any) -> Optional[tuple]:
    """(ratio, whose): decode tok/s / prefill tok/s of the same run (the load cancels), the median over this
    model's runs on this CPU under any thread setting, else over all of this CPU's runs; None where no run has
    both."""
    mine, everyone = [], []
    for key, entry in data.items():
        parts = _split_key(key)
        if parts is None or parts[4] != cpu_kind():
            continue
        for r in _runs_of(entry):
            if _rate(r, RATES[0]) and _rate(r, RATES[1]):
                ratio = _rate(r, RATES[1]) / _rate(r, RATES[0])
                everyone.append(ratio)
                if parts[0] == str(model):
                    mine.append(ratio)
    if mine:
        return statistics.median(mine), "this model's"
    return (statistics.median(everyone), "this CPU's") if everyone else None


def _nearest_model(data: dict, model: Any, dtype: Any, device: Any, threads: Any,
                   model_bytes: Optional[float]) -> Optional[tuple]:
    """(key, runs, bytes) of this CPU's model nearest in weight bytes, with the same dtype, device and threads."""
    if not _positive(model_bytes) or not model_bytes:
        return None
    best = None
    for key, entry in data.items():
        parts = _split_key(key)
        if parts is None or parts[0] == str(model) or parts[1:] != _split_key(_key(model, dtype, device, threads))[1:]:
            continue
        runs = _runs_of(entry)
        sizes = [r["model_bytes"] for r in runs if _positive(r.get("model_bytes")) and r["model_bytes"] > 0]
        if not sizes or not any(_rate(r, RATES[0]) for r in runs):
            continue
        distance = abs(math.log(sizes[-1] / model_bytes))
        if best is None or distance < best[0]:
            best = (distance, key, runs, sizes[-1])
    return None if best is None else best[1:]


def measured_speed(model: Any, dtype: Any, device: Any, threads: Any = None, *, task: Optional[str] = None,
                   method: Optional[str] = None, model_bytes: Optional[float] = None,
                   load: Optional[float] = None, cpus: Optional[int] = None) -> Optional[dict]:
    """This machine's figures for a run, at the load now (others_load() unless given) -- {prefill_tokens_per_s,
    decode_tokens_per_s, load_s, logger_start_s, overhead_s: {task: s}, runs, measured_at, run_id, others_load,
    basis: [how each figure was found]} (a figure nothing measured is missing) -- or None when no run of this
    model (or, with model_bytes, of another model on this CPU) was kept. `method` is the method with its codec
    (record's method_id: "paged_eviction+kivi")."""
    data = _read_all()
    cpus = cpus or os.cpu_count() or 1
    now = _Now(others_load() if load is None else load, cpus, threads_used(threads, cpus))
    key = _key(model, dtype, device, threads)
    runs, size_factor, basis = _runs_of(data.get(key)), 1.0, []
    if not runs:
        near = _nearest_model(data, model, dtype, device, threads, model_bytes)
        if near is None:
            return None
        key, runs, their_bytes = near
        size_factor = model_bytes / their_bytes  # seconds scale with the weights read and multiplied
        basis.append(f"no run of this model: {_split_key(key)[0]}'s runs, times its size ({size_factor:.2f}x)")
    target = {"task": task, "method": method}
    out: dict = {"others_load": now.load, "runs": 0}
    used_runs: dict = {}
    known_load = [r for r in runs if _positive(r.get(LOAD_FIELD))]
    for name, tier, pool in [(n, t, p) for n in RATES for p in (known_load, runs) for t in TIERS]:
        # runs measured at a known load first, down every tier; runs of unknown load (kept before the load was)
        # only where no such run has the figure: a narrower tier's run at an unknown load can be many times off
        if name in out:
            continue
        found = now.nearest(_tier_runs(pool, target, tier), lambda r, n=name: _rate(r, n), rate=True)
        if found is None:
            continue
        value, used = found
        if tier != TIERS[0]:
            factor = _tier_factor(data, key, target, tier, name, cpus, now.threads)
            what = " and ".join(tier) or "any task or method"
            basis.append(f"{name.split('_')[0]} from runs of the same {what}" if tier else
                         f"{name.split('_')[0]} from runs of other tasks and methods")
            if factor is not None:
                value *= factor
                basis[-1] += f" times {factor:.2f} (measured on other models)"
        out[name] = value / size_factor
        used_runs.update({id(r): r for r in used})
    if RATES[1] not in out and RATES[0] in out:
        found = _decode_per_prefill(data, model)
        if found is not None:
            out[RATES[1]] = out[RATES[0]] * found[0]
            basis.append(f"decode from prefill at {found[1]} decode/prefill ratio {found[0]:.3f}")
    for tier in TIERS[:2]:  # the share of the most it may generate that the task's runs generated
        shares = [float(r["generated_fraction"]) for r in _tier_runs(runs, target, tier)
                  if task is not None and isinstance(r.get("generated_fraction"), (int, float))
                  and 0 <= r["generated_fraction"] <= 1]
        if shares:
            out["generated_fraction"] = min(1.0, statistics.median(shares))
            basis.append(f"generated {out['generated_fraction']:.0%} of the most, as {len(shares)} run(s) of the "
                         f"same {' and '.join(tier)}")
            break
    for name in FIXED:
        found = now.nearest(runs, lambda r, n=name: float(r[n]) if _positive(r.get(n)) else None, rate=False)
        if found is not None:
            out[name] = found[0] * size_factor
    overheads: dict = {}
    for r in runs:
        if _positive(r.get("overhead_s")) and r.get("task"):
            overheads.setdefault(str(r["task"]), []).append(r)
    out["overhead_s"] = {t: now.nearest(v, lambda r: float(r["overhead_s"]), rate=False)[0] * size_factor
                         for t, v in overheads.items()}
    used = list(used_runs.values()) or runs
    loads = [r[LOAD_FIELD] for r in used if _positive(r.get(LOAD_FIELD))]
    out.update(runs=len(used), measured_at=max(str(r.get("measured_at", "?")) for r in used),
               run_id=runs[-1].get("run_id"), basis=basis,
               measured_load=(min(loads), max(loads)) if loads else None)
    return out


# ---------------------------------------------------------------------------------------------- keeping a run
def method_id(method: Any, quant: Any = None) -> str:
    """A run's method with its storage codec: "snapkv", "paged_eviction+kivi" (a codec changes the speed)."""
    return f"{method}+{quant}" if quant not in (None, "", "none") else str(method)


def weights_bytes(path: Any, gguf_file: Any = None) -> Optional[int]:
    """The bytes of a local model's weights (its GGUF file, or a folder's .safetensors/.bin/.gguf files), the
    size fallback's measure; None for a hub id or anything unreadable."""
    try:
        if path is None:  # the packaged SmolLM2
            return os.path.getsize(os.path.join(*packaged_smollm2()))
        gguf = gguf_location(path, gguf_file)
        if gguf is not None:
            return os.path.getsize(gguf)
        folder = os.path.expanduser(str(path))
        if not os.path.isdir(folder):
            return None
        total = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)
                    if n.endswith((".safetensors", ".bin", ".gguf")))
        return total or None
    except Exception:  # the estimate is a courtesy: a model it cannot size gets no size fallback
        return None


def record_speed(record: dict, threads: Any = None, workload: Any = None, *, load_at_start: Optional[float] = None,
                 model_bytes: Optional[float] = None) -> None:
    """Keep a finished run's figures for the next runs' estimates: its rates (each only when measured), its logger
    start, its model load (only when the model was loaded, not held from an earlier run of the process), its
    overhead (wall time beyond those and its tokens at its own rates, given the workload), its task and method, the
    other processes' load while it ran (the mean of load_at_start and others_load() now) and the CPU count. The
    newest KEEP runs per key stay; written atomically; a failure to write is ignored (the estimate is a
    courtesy)."""
    if record.get("status") != "ok":
        return
    run: dict = {k: float(record[k]) for k in RATES if _rate(record, k) is not None}
    if not run:
        return
    for name in FIXED:
        if _positive(record.get(name)) and not (name == "load_s" and record.get("model_cached")):
            run[name] = round(float(record[name]), 3)
    generated = record.get("generated_tokens")
    if workload is not None and workload.new_tokens and isinstance(generated, (int, float)) and generated >= 0:
        run["generated_fraction"] = round(min(1.0, generated / workload.new_tokens), 4)
    wall = record.get("wall_s")
    if workload is not None and _positive(wall):
        tokens = token_seconds(workload, run)
        if tokens is not None:
            fixed = sum(float(record[k]) for k in FIXED if _positive(record.get(k)))
            run["overhead_s"] = round(max(0.0, float(wall) - fixed - tokens), 3)
    loads = [x for x in (load_at_start, others_load()) if _positive(x)]
    if loads:
        run[LOAD_FIELD] = round(sum(loads) / len(loads), 2)
    run["cpus"] = os.cpu_count()
    if _positive(model_bytes) and model_bytes:
        run["model_bytes"] = int(model_bytes)
    run.update(task=record.get("task"), method=method_id(record.get("method"), record.get("quant")),
               measured_at=_dt.date.today().isoformat(), run_id=record.get("run_id"))
    path = _speed_path()
    try:
        data = _read_all()
        key = _key(record.get("model"), record.get("dtype"), record.get("device"), threads)
        data[key] = {"runs": (_runs_of(data.get(key)) + [run])[-KEEP:]}
        atomic_write.write_text(path, json.dumps(data, indent=1, sort_keys=True), mode=0o600)  # this user's, as before
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------- a sweep's estimate
_sweep: dict = {}  # the sweep's estimate, printed before its first job, for that job's record


def note_sweep_estimate(seconds: Optional[float]) -> None:
    """Keep the sweep's estimate (and this process's age at its line) for its first run's record."""
    age = process_age_s()
    _sweep.clear()
    _sweep.update(sweep_estimate_s=None if seconds is None else round(seconds, 2),
                  sweep_announced_after_s=None if age is None else round(age, 2))


def take_sweep_estimate() -> dict:
    """{sweep_estimate_s, sweep_announced_after_s} once, for the sweep's first run; {} after, and outside a sweep."""
    out = dict(_sweep)
    _sweep.clear()
    return out


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
    """prompt tokens / prefill rate + generated tokens / decode rate (the workload's most times the measured share
    generated, speed's generated_fraction, 1 where none); None when a needed rate was never measured."""
    if not speed:
        return None
    total = 0.0
    generated = workload.new_tokens * speed.get("generated_fraction", 1.0)
    for tokens, rate in ((workload.prompt_tokens, speed.get("prefill_tokens_per_s")),
                         (generated, speed.get("decode_tokens_per_s"))):
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


def _basis(speed: dict, model_loaded: bool, workload: Any) -> str:
    """What the estimate stands on, in words: the load, the rates the workload needs and the runs they come
    from."""
    needed = [k for k, n in zip(RATES, (workload.prompt_tokens, workload.new_tokens)) if n and speed.get(k)]
    rates = " and ".join(f"{speed[k]:,.1f} {k.split('_')[0]}" for k in needed)
    basis = [b for b in speed.get("basis") or () if not any(b.startswith(k.split("_")[0]) for k in RATES) or
             any(b.startswith(k.split("_")[0]) for k in needed)]
    load = "" if model_loaded or "load_s" not in speed else f"model load {speed['load_s']:.0f} s, "
    runs = speed.get("runs", 1)
    text = f"{load}{rates} tok/s"
    if speed.get("others_load") is not None:
        text += f" at load {speed['others_load']:.1f}"
    text += f": the median of {runs} run{'s' if runs != 1 else ''} measured on this machine"
    measured = speed.get("measured_load")
    if measured:
        low, high = measured
        text += f" at load {low:.1f}" + (f"-{high:.1f}" if high > low else "")
    text += f", latest {speed.get('measured_at', '?')}"
    return text + "".join(f"; {b}" for b in basis)


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
        when = f"; about {duration(seconds)} here ({_basis(speed, model_loaded, workload)})"
    return f"{work}{when}; shorten with {workload.shorten}"


def sweep_line(estimates: list) -> str:
    """A sweep's line before its first job: the sum of its jobs' estimates (each job's from estimate_seconds, the
    model's load counted once per model), or which jobs have none."""
    known = [s for s in estimates if isinstance(s, (int, float)) and math.isfinite(s)]
    n = len(estimates)
    if not known:
        return f"kvbench: sweep of {n} run(s); no speed measured on this machine for its model(s) yet"
    missing = n - len(known)
    total = f"about {duration(sum(known))} here in all, the sum of its runs' estimates"
    if missing:
        total += f" ({missing} of them without one: nothing measured yet)"
    return f"kvbench: sweep of {n} run(s): {total}"
