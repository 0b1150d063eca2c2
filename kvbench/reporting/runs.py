"""The settings of run records (kvbench.store.runs.load_runs): the key that pairs the same configuration across
code versions, and the short names of settings that report tables and compare verdicts show.

    pair_key(run), result_keys(run), describe(run), varying_keys(runs), setting_of(run, keys), fmt(value),
    setting_sort_key(run, keys)

The pair key hashes the parts of the config that change a result (model, method, quant, task, runtime, budget,
seed), without anything that names the code version, so the same setting run at two commits (or in two folders)
gets the same key. It reads only the record: config.yaml is written resolved (a storage codec under `quant`) and
metrics.json says whether the method evicts (`evicts`: false makes the budget and ratio irrelevant); a record
from before `evicts` was written is paired as it was recorded.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from kvbench.store.runs import flatten

# Config sections that determine a result (kvbench.run.config.hashable_config) and keys in them that do not.
RESULT_SECTIONS = ("model", "method", "quant", "task", "runtime", "budget", "compression_ratio", "seed",
                   "data_sha256", "method_files_sha256")  # digests of local data files and of a method's own files
NOT_RESULT_KEYS = {"model": ("cache_dir",), "runtime": ("threads",)}


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
            "_config_hash": m.get("config_hash"), "data_sha256": m.get("data_sha256"),
            "method_files_sha256": m.get("method_files_sha256")}
    for key in ("data_sha256", "method_files_sha256"):  # no local files, or a run from before the digest
        if out.get(key) is None:
            out.pop(key, None)
    if run["metrics"].get("data_revision") is not None:  # hub data: the commits read (kvbench.data.hub)
        out["data_revision"] = run["metrics"]["data_revision"]
    out = json.loads(json.dumps(out, default=str))
    for section, keys in NOT_RESULT_KEYS.items():
        if isinstance(out.get(section), dict):
            for key in keys:
                out[section].pop(key, None)
    out["method"] = dict(out.get("method") or {})
    out["quant"] = dict(out.get("quant") or {"name": "none"})
    if out["quant"].get("name") in (None, "full"):  # the two spellings of "no codec"
        out["quant"]["name"] = "none"
    if run["metrics"].get("evicts") is False:  # nothing is evicted: every budget (or ratio) is the same run
        out["budget"] = out["compression_ratio"] = None
    return out


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
        # method_source_sha256 (the digest of the method's own source files) follows from the method, as its options do
        section = "method" if key == "method_source_sha256" else key.split(".")[0]
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


def sort_value(value: Any) -> tuple:
    """A sort key that orders numbers as numbers (96 < 112 < 1024), then text, then missing values."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return (0, float(value), "")
    if value is None or value == "":
        return (2, 0.0, "")
    return (1, 0.0, str(value))


def setting_sort_key(run: dict, keys: list[str]) -> tuple:
    """The run's setting (setting_of's keys) as a sort key: numbers sorted as numbers, not as text."""
    return tuple(sort_value(run["cfg"].get(key)) for key in keys) + (setting_of(run, keys),)


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
