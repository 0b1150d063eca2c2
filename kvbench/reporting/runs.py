"""Runs of a results folder as plain records (metrics.json + the flattened config.yaml), and the key that pairs the
same configuration across code versions.

    runs = load_runs(results_dir)                  # latest attempt of every run folder
    runs = load_runs(results_dir, history=True)    # every line of runs.jsonl (all attempts, all commits)
    run["cfg"]["method.sinks"], run["metrics"]["ppl"], run["run_dir"], pair_key(run)

A results folder is the truth (DESIGN.md): metrics.json of each run folder, config.yaml beside it, runs.jsonl the
log of every finished attempt. The pair key hashes the parts of the config that change a result (model, method,
quant, task, runtime, budget, seed), without anything that names the code version, so the same setting run at two
commits (or in two folders) gets the same key.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Optional

from kvbench.results import CONFIG_FILE, METRICS_FILE, RUNS_FILE, SAMPLES_FILE, read_json, read_jsonl

# Config sections that determine a result (kvbench.config.hashable_config) and keys in them that do not.
RESULT_SECTIONS = ("model", "method", "quant", "task", "runtime", "budget", "compression_ratio", "seed")
NOT_RESULT_KEYS = {"model": ("cache_dir",), "runtime": ("threads",)}


def read_config(run_dir: str) -> dict:
    """The run's resolved config.yaml as a dict ({} when missing or unreadable)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
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
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
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


def make_run(results_dir: str, metrics: dict, config: Optional[dict] = None) -> dict:
    """One run record: metrics, config (nested) and cfg (flattened), its folder, experiment and paper block."""
    run_dir = _run_dir(results_dir, metrics)
    config = read_config(run_dir) if config is None else config
    experiment = metrics.get("experiment") or config.get("experiment")
    return {"metrics": metrics, "config": config, "cfg": flatten(config), "run_dir": os.path.abspath(run_dir),
            "run_id": metrics.get("run_id"), "experiment": experiment, "paper": config.get("paper")}


def load_runs(results_dir: str, *, history: bool = False, include_failed: bool = True) -> list[dict]:
    """Runs of a results folder: the latest attempt of each run folder, or (history=True) every finished attempt
    logged in runs.jsonl (one per run and commit; superseded attempts keep their metrics, not their samples)."""
    results_dir = os.path.abspath(results_dir)
    records: Iterable[dict]
    if history:
        records = read_jsonl(os.path.join(results_dir, RUNS_FILE))
    else:
        records = []
        for name in sorted(os.listdir(results_dir)) if os.path.isdir(results_dir) else []:
            rec = read_json(os.path.join(results_dir, name, METRICS_FILE))
            if rec is not None and rec.get("run_id"):
                records.append(rec)
    configs: dict = {}
    out = []
    for rec in records:
        if not include_failed and rec.get("status") != "ok":
            continue
        run_dir = _run_dir(results_dir, rec)
        if run_dir not in configs:
            configs[run_dir] = read_config(run_dir)
        out.append(make_run(results_dir, rec, configs[run_dir]))
    return out


def runs_frame(runs: list[dict]) -> "Any":
    """A pandas DataFrame with one row per run: the metrics.json fields, then the config as `cfg.<dotted key>`
    columns (the paper block left out), then run_dir and experiment."""
    import pandas as pd

    rows = []
    for run in runs:
        row = dict(run["metrics"])
        row.update({f"cfg.{k}": (v if not isinstance(v, (list, dict)) else str(v))
                    for k, v in run["cfg"].items() if not k.startswith("paper.")})
        row["run_dir"], row["experiment"] = run["run_dir"], run["experiment"]
        rows.append(row)
    return pd.DataFrame(rows)


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


def _result_config(run: dict) -> dict:
    """The parts of the run's config that determine its result (from config.yaml, else from metrics.json)."""
    cfg = run.get("config") or {}
    if cfg:
        out = {k: cfg.get(k) for k in RESULT_SECTIONS}
    else:  # no config.yaml: the flat metrics fields that describe the setting
        m = run["metrics"]
        out = {"model": {"name": m.get("model")}, "method": {"name": m.get("method"), **{
            k[len("method_"):]: v for k, v in m.items() if k.startswith("method_")}},
            "quant": {"name": m.get("quant") or "none", **{k[len("quant_"):]: v for k, v in m.items()
                                                          if k.startswith("quant_")}},
            "task": {"name": m.get("task")}, "budget": m.get("budget"),
            "compression_ratio": m.get("compression_ratio"), "seed": m.get("seed"),
            "_config_hash": m.get("config_hash")}
    out = json.loads(json.dumps(out, default=str))
    for section, keys in NOT_RESULT_KEYS.items():
        if isinstance(out.get(section), dict):
            for key in keys:
                out[section].pop(key, None)
    return _normalise_storage(out)


def _normalise_storage(cfg: dict) -> dict:
    """method=kivi and method=full quant=kivi are the same run; a budget does not matter to a method that does not
    evict. Uses the lead's kvbench.quant.registry.resolve_storage and Method.evicts where they exist."""
    method = dict(cfg.get("method") or {})
    quant = dict(cfg.get("quant") or {"name": "none"})
    try:
        from kvbench import spec

        resolve = spec.resolve_storage
        if resolve is not None and method.get("name"):
            m_name, m_opts, q_name, q_opts = resolve(method.pop("name"), method, quant.pop("name", "none"), quant)
            method, quant = {"name": m_name, **(m_opts or {})}, {"name": q_name, **(q_opts or {})}
    except Exception:
        method, quant = dict(cfg.get("method") or {}), dict(cfg.get("quant") or {"name": "none"})
    cfg = dict(cfg, method=method, quant=quant)
    try:
        from kvbench.methods import METHODS

        cls = METHODS.get(method.get("name"))
        if cls is not None and getattr(cls, "evicts", True) is False:
            cfg["budget"] = cfg["compression_ratio"] = None
    except Exception:
        pass
    return cfg


def pair_key(run: dict, only: Optional[set] = None) -> str:
    """A short hash of the run's result-determining config, the same across code versions and results folders.
    With `only` (a set of flattened keys), just those keys count (see result_keys)."""
    cfg = _result_config(run)
    if only is not None:
        cfg = {k: v for k, v in flatten(cfg).items() if k in only}
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def result_keys(run: dict) -> set:
    """The flattened keys of the run's result-determining config (a newer version may add keys with defaults)."""
    return set(flatten(_result_config(run)))


def describe(run: dict) -> str:
    """A short readable name of the run's setting: model task method[+quant] b<budget> (and block size if not 16)."""
    cfg, m = run["cfg"], run["metrics"]
    method = cfg.get("method.name") or m.get("method") or "?"
    quant = cfg.get("quant.name") or m.get("quant") or "none"
    if quant not in ("none", "full", None):
        bits = cfg.get("quant.bits")
        method += f"+{quant}" + (f"{bits}" if bits is not None else "")
    parts = [str(m.get("model") or cfg.get("model.name") or cfg.get("model.path") or "?"),
             str(cfg.get("task.name") or m.get("task")), method, f"b{m.get('budget')}"]
    bs = cfg.get("runtime.block_size")
    if bs not in (None, 16):
        parts.append(f"bs{bs}")
    return " ".join(parts)


# Config keys never shown as a run's setting (bookkeeping, or the paper block itself).
HIDDEN = ("paper.", "experiment", "results_dir", "rerun", "progress", "logger.", "model.cache_dir",
          "runtime.threads", "hydra.")


def fmt(value: Any, digits: int = 5) -> str:
    """A number for a table cell: 5 significant digits, thousands separated."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.2f}"
    return str(value)


def _shown(key: str) -> bool:
    return not any(key == h or key.startswith(h) for h in HIDDEN)


def varying_keys(runs: list[dict]) -> list[str]:
    """Config keys whose values differ between the runs (the axes of the experiment's sweep)."""
    keys = sorted({k for r in runs for k in r["cfg"] if _shown(k)},
                  key=lambda k: (k.split(".")[0], not k.endswith(".name") and k != "model.path", k))
    out = []
    for key in keys:
        section = key.split(".")[0]
        if section in ("method", "quant", "task") and key != f"{section}.name":
            # a method's (codec's, task's) option varies only if it differs between runs of that same method (codec, task)
            groups: dict = {}
            for r in runs:
                if key in r["cfg"]:
                    groups.setdefault(r["cfg"].get(f"{section}.name"), set()).add(repr(r["cfg"][key]))
            varies = any(len(v) > 1 for v in groups.values())
        else:
            varies = len({repr(r["cfg"].get(key)) for r in runs}) > 1
        if varies:
            out.append(key)
    return out


def _short(key: str) -> str:
    return {"method.name": "method", "quant.name": "quant", "model.path": "model", "model.name": "model",
            "runtime.block_size": "block", "task.name": "task"}.get(key, key)


def setting_of(run: dict, keys: list[str]) -> str:
    parts = []
    for key in keys:
        if key not in run["cfg"]:
            continue
        value = run["cfg"][key]
        if key == "budget" and value is None:
            value = "none"
        parts.append(f"{_short(key)}={fmt(value)}")
    return ", ".join(parts) or describe(run)
