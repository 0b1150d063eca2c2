"""Names in the results store: the run id of a config, the model's label in it, and the hashes that tell runs and
experiments apart.

The run id is derived from the result-determining config (`hashable_config` of kvbench.run.config: model, method,
quant, task, runtime, budget, seed), so running the same config again finds the finished run and skips it unless
rerun=true.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from typing import Any

# Keys that do not change what a run computes, so they are left out of the config hash.
UNHASHED_KEYS = {"model": ("cache_dir",), "runtime": ("threads", "cuda_graphs")}  # speed only, same results
# The packaged model's config name: with model.path set, the folder is named after the path instead.
PACKAGED_MODEL_NAME = "smollm2-135m"


def config_hash(hashable: dict) -> str:
    """A short stable hash of the parts of a config that determine the result."""
    data = copy.deepcopy(hashable)
    for section, keys in UNHASHED_KEYS.items():
        if isinstance(data.get(section), dict):
            for key in keys:
                data[section].pop(key, None)
    text = json.dumps(data, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def slug(value: Any) -> str:
    """The value as a file-name- and URL-safe word: letters, digits, `.`, `_` and `-` kept (configured names such as
    `paged_eviction` stay as written), runs of other characters become one `-`; never empty and never starting with
    `.` or `-` (`..` or `.hidden` would name a hidden folder that report and compare skip, `-x` reads as an option)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(value)).lstrip(".-").rstrip("-") or "x"


def model_label(model: dict) -> str:
    """The model's name in run ids: model.name, or the basename of model.path when a path replaces the
    packaged model (model.path=/x/Llama-3.2-1B under the default model config names the run Llama-3.2-1B)."""
    name, path = model.get("name"), model.get("path")
    if path and (not name or name == PACKAGED_MODEL_NAME):
        local = os.path.expanduser(str(path))
        base = os.path.basename(os.path.abspath(local) if os.path.isabs(local) or os.path.exists(local)
                                else os.path.normpath(local))  # `.` or `..`: the folder's own name
        if model.get("gguf_file"):
            base = os.path.splitext(str(model["gguf_file"]))[0]
        return base or "model"
    return str(name or "model")


def run_id_for(hashable: dict) -> str:
    """`<model>_<task>_<method>_b<budget>_s<seed>_<hash>`, or `..._r<compression_ratio>_...` for a ratio run:
    readable (method and task as configured; a codec joined with `-`: `paged_eviction-kivi`), and the same for the
    same config."""
    model = hashable.get("model") or {}
    task = (hashable.get("task") or {}).get("name", "task")
    method = (hashable.get("method") or {}).get("name", "method")
    quant = (hashable.get("quant") or {}).get("name", "none")
    if quant not in ("none", "full", None):
        method = f"{method}-{quant}"
    budget, ratio = hashable.get("budget"), hashable.get("compression_ratio")
    knob = "b" + slug(budget) if budget is not None else ("r" + slug(ratio) if ratio is not None else "bnone")
    parts = [slug(model_label(model)), slug(task), slug(method), knob, "s" + slug(hashable.get("seed", 0)),
             config_hash(hashable)]
    return "_".join(parts)


def experiment_key(hashable: dict) -> str:
    """A hash of everything that changes a result except the compression axes (method, quant, budget): the runs
    of one experiment share it, so a pivot over method and budget never mixes task, model or runtime settings."""
    rest = {k: v for k, v in hashable.items() if k not in ("method", "quant", "budget")}
    return config_hash(rest)
