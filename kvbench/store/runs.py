"""A results folder read as run records: one loader for the report, compare and pandas.

    runs = load_runs(results_dir)                  # the latest attempt of every run folder
    runs = load_runs(results_dir, history=True)    # every line of runs.jsonl (all attempts, all commits)
    run["metrics"]["ppl"], run["cfg"]["method.sinks"], run["config"], run["run_dir"], run["experiment"]

A run record is {"metrics": the metrics.json object (or runs.jsonl line), "config": config.yaml as a dict,
"cfg": the same flattened ({"method.sinks": 4}), "run_dir", "run_id", "experiment", "paper": the config's paper
block}. kvbench.store.table turns the records into a pandas DataFrame.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional

from omegaconf import OmegaConf

from kvbench.console import warn
from kvbench.store.files import read_json, read_jsonl
from kvbench.store.folder import CONFIG_FILE, METRICS_FILE, RUNS_FILE, SAMPLES_FILE, repair_index, run_folders


def _load_yaml(path: str) -> Any:
    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)


def read_config(run_dir: str) -> dict:
    """The run's resolved config.yaml as a dict ({} when missing or unreadable)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        cfg = _load_yaml(path)
        return cfg if isinstance(cfg, dict) else {}
    except Exception:
        return {}


def _metrics_problem(path: str) -> Optional[str]:
    """Why a metrics.json cannot be read as a run's record, or None when it can."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        return f"metrics.json cannot be read: {exc.strerror or exc}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "metrics.json is not valid UTF-8"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return f"metrics.json is not valid JSON (truncated?): {exc}"
    if not isinstance(data, dict):
        return f"metrics.json holds a {type(data).__name__}, not a mapping"
    if not data.get("run_id"):
        return "metrics.json has no run_id"
    return None


def _config_problem(path: str) -> Optional[str]:
    """Why a config.yaml cannot be read as a run's config, or None when it can."""
    if not os.path.isfile(path):
        return "config.yaml is missing"
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8")
    except OSError as exc:
        return f"config.yaml cannot be read: {exc.strerror or exc}"
    except UnicodeDecodeError:
        return "config.yaml is not valid UTF-8"
    try:
        cfg = _load_yaml(path)
    except Exception as exc:
        return f"config.yaml is not valid YAML: {' '.join(str(exc).split())[:120]}"
    if not isinstance(cfg, dict):
        return f"config.yaml holds a {type(cfg).__name__}, not a mapping"
    return None


def corrupt_runs(results_dir: str) -> list[tuple[str, str]]:
    """(folder name, one-line reason) of every run folder of results_dir whose metrics.json or config.yaml cannot
    be read: not UTF-8, not JSON/YAML (e.g. truncated), not a mapping, metrics without a run_id, config missing.
    Only folders with a metrics.json count (a folder without one holds a run that has not finished)."""
    out = []
    try:
        names = sorted(os.listdir(results_dir))
    except OSError:
        return []
    for name in names:
        folder = os.path.join(results_dir, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(folder, METRICS_FILE)):
            continue
        reason = _metrics_problem(os.path.join(folder, METRICS_FILE)) or \
            _config_problem(os.path.join(folder, CONFIG_FILE))
        if reason is not None:
            out.append((name, reason))
    return out


def flatten(data: Any, prefix: str = "") -> dict:
    """{"method": {"sinks": 4}} -> {"method.sinks": 4}; lists are kept as values."""
    out: dict = {}
    if isinstance(data, dict):
        for key, value in data.items():
            name = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                out.update(flatten(value, name))
            else:
                out[name] = value
    return out


def _run_dir(results_dir: str, metrics: dict) -> str:
    """A record's run folder: its run_id under results_dir (the folder may have moved since run_dir was written)."""
    run_id = metrics.get("run_id")
    if run_id and os.path.isdir(os.path.join(results_dir, run_id)):
        return os.path.join(results_dir, run_id)
    return metrics.get("run_dir") or os.path.join(results_dir, str(run_id))


def make_run(results_dir: str, metrics: dict, config: Optional[dict] = None, run_dir: Optional[str] = None) -> dict:
    """One run record: metrics, config (nested) and cfg (flattened), its folder (run_dir: the folder the record was
    read from, else found from the record), the results folder, experiment and paper block."""
    run_dir = run_dir or _run_dir(results_dir, metrics)
    config = read_config(run_dir) if config is None else config
    experiment = metrics.get("experiment") or config.get("experiment")
    return {"metrics": metrics, "config": config, "cfg": flatten(config), "run_dir": os.path.abspath(run_dir),
            "results_dir": os.path.abspath(results_dir), "run_id": metrics.get("run_id"), "experiment": experiment,
            "paper": config.get("paper")}


def _latest_records(results_dir: str, warn_corrupt: bool) -> list[tuple[str, dict]]:
    """(folder, metrics.json) of every run folder; unreadable ones (or without a run_id) left out, with one
    warning. The folder is where the record was read, whatever its run_dir field says."""
    records, corrupt = [], []
    for folder in run_folders(results_dir):
        rec = read_json(os.path.join(folder, METRICS_FILE))
        if rec is None or not rec.get("run_id"):
            corrupt.append(os.path.basename(folder))
        else:
            records.append((folder, rec))
    if corrupt and warn_corrupt:
        warn(f"skipped {len(corrupt)} run folder(s) with a corrupt metrics.json in {results_dir}: "
             f"{', '.join(corrupt[:5])}{' ...' if len(corrupt) > 5 else ''}")
    return records


def load_runs(results_dir: Any, *, history: bool = False, include_failed: bool = True, repair: bool = True,
              warn_corrupt: bool = True) -> list[dict]:
    """The runs of a results folder (or of a list of them, in order) as run records (see the module docstring).

    The latest attempt of each run folder (its metrics.json), or with history=True every attempt logged in
    runs.jsonl (one per run and commit; superseded attempts keep their metrics, not their samples). A folder whose
    metrics.json cannot be read is left out, with a warning unless warn_corrupt=False (kvbench-report and
    kvbench-compare name such folders themselves: corrupt_runs). With repair=True the index first gets any finished
    attempt it lacks (a read-only folder is still read); include_failed=False keeps status "ok" only."""
    if isinstance(results_dir, (list, tuple)):
        if not results_dir:
            raise ValueError("load_runs: the list of results folders is empty")
        return [run for one in results_dir for run in load_runs(one, history=history, include_failed=include_failed,
                                                                repair=repair, warn_corrupt=warn_corrupt)]
    if not isinstance(results_dir, (str, os.PathLike)):
        raise ValueError(f"load_runs: invalid results folder {results_dir!r}: expected a path or a list of paths")
    results_dir = os.path.abspath(results_dir)
    if repair:
        try:
            repair_index(results_dir)
        except OSError:
            pass  # a read-only results folder is still readable
    records: Iterable[tuple[Optional[str], dict]]
    if history:
        records = [(None, rec) for rec in read_jsonl(os.path.join(results_dir, RUNS_FILE))]
    else:
        records = _latest_records(results_dir, warn_corrupt)
    configs: dict = {}
    out = []
    for folder, rec in records:
        if not include_failed and rec.get("status") != "ok":
            continue
        run_dir = folder or _run_dir(results_dir, rec)
        if run_dir not in configs:
            configs[run_dir] = read_config(run_dir)
        out.append(make_run(results_dir, rec, configs[run_dir], run_dir))
    return out


def samples_of(run: dict) -> Optional[list[dict]]:
    """The run's samples.jsonl, or None when the folder's samples belong to another attempt (or are missing)."""
    current = read_json(os.path.join(run["run_dir"], METRICS_FILE)) or {}
    mine = run["metrics"]
    for key in ("finished_at", "started_at", "git_commit"):
        if mine.get(key) is not None and current.get(key) != mine.get(key):
            return None
    path = os.path.join(run["run_dir"], SAMPLES_FILE)
    if not os.path.isfile(path):
        return None
    return read_jsonl(path)
