"""`python bench/first_hour.py`: the times a newcomer meets in the first hour, measured on this machine and dated.

Each figure is timed here, in fresh folders, and printed as one JSON line (date, host, CPU count, load average):
  convert_s        first use of the packaged GGUF: conversion into a fresh KVBENCH_CACHE_DIR (the first load,
                   minus a second, warm load)
  compile_s        the CPU kernels compiled into a fresh KVBENCH_CACHE_DIR
  first_runs       each command of README.md's "First runs" block, as written (a fresh results folder; the
                   converted model and kernels warm), with its wall time and whether it finished within --limit;
                   its estimate (what its first line said: the process's age at the line plus the run's
                   estimate_s, or for a sweep its sweep_estimate_s, the sum of its runs') and ratio = actual /
                   estimate, within_2x when 0.5 <= ratio <= 2 (the issue's target; null for a command killed at
                   --limit + 60 s: its ratio is then only a lower bound), the load at its start and its first line; then one first_runs_summary line (how many within 2x); with --competing beside one
                   busy process; a command marked "GPU-sized" or needing the network (model=hf) is listed, not run
  install_s        (--install only) `make install` into a fresh virtualenv, with the pip cache as it is
  kvzap_train_s    (--only kvzap_train) the packaged model's KVzap surrogates trained into a fresh cache (the first
                   kvzap run's training, kvbench-train-kvzap; the model converted there first, untimed)
With --write the convert, compile and kvzap_train figures go to kvbench/runtime/measured_times.json, which the first-run
messages quote ("about N s here, measured DATE"), so no time in a message is typed by hand.

    python bench/first_hour.py [--only convert,compile,first_runs,install] [--limit 600] [--competing] [--write]
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "kvbench" / "runtime" / "measured_times.json"
MARKERS_NOT_RUN = ("GPU-sized", "model=hf", "--help")


def stamp() -> dict:
    return {"date": _dt.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def emit(figure: str, **values) -> dict:
    line = {"figure": figure, **values, **stamp()}
    print(json.dumps(line), flush=True)
    return line


def _env(cache: str) -> dict:
    env = dict(os.environ, KVBENCH_CACHE_DIR=cache, WANDB_MODE="disabled")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _timed(cmd: list, env: dict, cwd: str, timeout: float, keep_stdout: bool = False) -> tuple:
    """(seconds, exit code) of a command, and its stdout too with keep_stdout."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE if keep_stdout else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=timeout)
        rc, out = done.returncode, (done.stdout or b"").decode(errors="replace")
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
    seconds = time.perf_counter() - t0
    return (seconds, rc, out) if keep_stdout else (seconds, rc)


def convert(tmp: str, timeout: float) -> dict:
    cache = os.path.join(tmp, "convert-cache")
    load = [sys.executable, "-c", "from kvbench.runtime.model.loading import load_model; load_model()"]
    first, rc1 = _timed(load, _env(cache), tmp, timeout)
    warm, rc2 = _timed(load, _env(cache), tmp, timeout)
    return emit("convert_s", seconds=round(first - warm, 1), first_load_s=round(first, 1),
                warm_load_s=round(warm, 1), ok=rc1 == 0 and rc2 == 0)


def compile_kernels(tmp: str, timeout: float) -> dict:
    cache = os.path.join(tmp, "compile-cache")
    code = "from kvbench.runtime.backends.cpu import kernels as k; k.load_kernel(); assert k.available()"
    seconds, rc = _timed([sys.executable, "-c", code], _env(cache), tmp, timeout)
    return emit("compile_s", seconds=round(seconds, 1), ok=rc == 0)


def kvzap_train(tmp: str, timeout: float) -> dict:
    cache = os.path.join(tmp, "kvzap-cache")
    warm = [sys.executable, "-c", "from kvbench.runtime.model.loading import load_model; load_model()"]
    _timed(warm, _env(cache), tmp, timeout)  # the conversion, not timed
    code = "import sys; from kvbench.methods.kvzap_train import main; sys.exit(main([]))"
    seconds, rc = _timed([sys.executable, "-c", code], _env(cache), tmp, timeout)
    return emit("kvzap_train_s", seconds=round(seconds, 1), ok=rc == 0)


def readme_first_runs() -> list[str]:
    """The command lines of README.md's "First runs" block (comments kept: they say GPU-sized)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"## First runs\s+```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip().startswith("python -m kvbench")]


def first_runs(tmp: str, limit: float, competing: bool = False) -> list:
    out = []
    with open(os.path.join(tmp, "my.txt"), "w") as f:  # the text file the README's example names
        f.write((REPO / "README.md").read_text() * 4)
    for i, line in enumerate(readme_first_runs()):
        command = line.split("#", 1)[0].strip()
        if any(m in line for m in MARKERS_NOT_RUN):
            out.append(emit("first_run", command=command, ran=False, why="marked GPU-sized, network or help"))
            continue
        args = shlex.split(command)[3:]  # after "python -m kvbench"
        args += [f"results_dir={os.path.join(tmp, f'results{i}')}", "logger.wandb=false"]
        env = dict(os.environ, WANDB_MODE="disabled")
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        load_at_start = round(os.getloadavg()[0], 2)
        seconds, rc, stdout = _timed([sys.executable, "-m", "kvbench", *args], env, tmp, limit + 60, keep_stdout=True)
        estimated = command_estimate(os.path.join(tmp, f"results{i}"))
        ratio, within_2x = judge(seconds, estimated, killed=rc == 124)
        first_line = next((x for x in stdout.splitlines() if x.startswith("kvbench:") and " prompt" in x
                           or x.startswith("kvbench: sweep of")), None)
        out.append(emit("first_run", command=command, seconds=round(seconds, 1), rc=rc, ran=True,
                        within_limit=rc == 0 and seconds <= limit, estimate_s=estimated, actual_s=round(seconds, 1),
                        ratio=ratio, ratio_is_lower_bound=rc == 124, within_2x=within_2x, competing=competing,
                        load_avg_1m_at_start=load_at_start, first_line=first_line))
    ran = [x for x in out if x.get("ran")]
    emit("first_runs_summary", commands_run=len(ran), with_estimate=sum(x["estimate_s"] is not None for x in ran),
         within_2x=sum(x["within_2x"] is True for x in ran), outside_2x=sum(x["within_2x"] is False for x in ran),
         unknown=sum(x["within_2x"] is None for x in ran), target="every command's estimate within 2x of its time",
         met=bool(ran) and all(x["within_2x"] is True for x in ran), competing=competing)
    return out


def judge(seconds: float, estimated: float | None, killed: bool) -> tuple:
    """(ratio = actual / estimate, within_2x): True when 0.5 <= ratio <= 2, False outside; for a command killed at
    its limit the ratio is a lower bound, so within_2x is None (unknown) unless even that bound is above 2 (and
    None where it was killed before its record kept the estimate); None and False where a finished command printed
    no estimate."""
    if not estimated:
        return None, (None if killed else False)  # killed before its record was written: its estimate is unknown
    ratio = round(seconds / estimated, 2)
    if killed:
        return ratio, (False if ratio > 2.0 else None)
    return ratio, 0.5 <= ratio <= 2.0


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def command_estimate(results_dir: str) -> float | None:
    """What the command's first lines promised, from its runs' metrics.json: for a sweep, the process's age at the
    sweep's line plus the sweep's estimate (sweep_estimate_s: the sum of its runs', printed before the first);
    else the run's process age at its line (announced_after_s: measured, the interpreter's start and imports)
    plus its estimate from its line to its end (estimate_s); None when a run printed none (or a figure is not a
    finite number: no ratio is made up)."""
    records = []
    for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
        path = os.path.join(results_dir, name, "metrics.json")
        if os.path.isfile(path):
            with open(path) as f:
                records.append(json.load(f))
    if not records:
        return None
    sweep = [r for r in records if r.get("sweep_estimate_s") is not None]
    if sweep:
        first = sweep[0]
        if not (_finite(first["sweep_estimate_s"]) and _finite(first.get("sweep_announced_after_s") or 0.0)):
            return None
        return round(float(first.get("sweep_announced_after_s") or 0.0) + float(first["sweep_estimate_s"]), 1)
    if len(records) > 1 or not _finite(records[0].get("estimate_s")):
        return None  # a sweep that printed no estimate, or a run that printed none
    run = records[0]
    if not _finite(run.get("announced_after_s") or 0.0):
        return None
    return round(float(run.get("announced_after_s") or 0.0) + float(run["estimate_s"]), 1)


def install(tmp: str, timeout: float) -> dict:
    venv = os.path.join(tmp, "venv")
    seconds, rc = _timed(["make", "-C", str(REPO), "install", f"VENV={venv}"], dict(os.environ), str(REPO), timeout)
    return emit("install_s", seconds=round(seconds, 1), ok=rc == 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="convert,compile,first_runs",
                    help="figures to measure (also: install, kvzap_train)")
    ap.add_argument("--limit", type=float, default=600.0, help="seconds a first-run command may take")
    ap.add_argument("--competing", action="store_true",
                    help="run the first-run commands beside one competing busy process (a spinning Python loop)")
    ap.add_argument("--write", action="store_true", help="store convert/compile/kvzap_train in " + str(MEASURED))
    args = ap.parse_args()
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory(prefix="kvbench-first-hour-") as tmp:
        measured = {}
        if "convert" in only:
            measured["convert"] = convert(tmp, 1800)
        if "compile" in only:
            measured["compile"] = compile_kernels(tmp, 1800)
        if "first_runs" in only:
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.competing else None
            try:
                first_runs(tmp, args.limit, args.competing)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
        if "install" in only:
            install(tmp, 3600)
        if "kvzap_train" in only:
            measured["kvzap_train"] = kvzap_train(tmp, 3600)
    if args.write and measured:
        data = json.loads(MEASURED.read_text()) if MEASURED.exists() else {}
        for name, line in measured.items():
            if line.get("ok"):
                run = {"seconds": line["seconds"], "date": line["date"], "cpus": line["cpus"],
                       "load_avg_1m": line["load_avg_1m"], "by": "bench/first_hour.py"}
                old = data.get(name) or {}
                runs = sorted([*(old.get("runs") or ([old] if "seconds" in old else [])), run],
                              key=lambda r: r.get("load_avg_1m") or 0.0)
                runs = [r for r in runs if isinstance(r, dict) and "seconds" in r]
                runs = runs if len(runs) <= 2 else [runs[0], runs[-1]]  # the quietest and the busiest
                data[name] = {**{k: v for k, v in runs[0].items()}, "runs": [dict(r) for r in runs]}
        MEASURED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
