"""Hand-made results folders for the report and compare tests: run folders as app.run writes them (config.yaml,
samples.jsonl, metrics.json last, a line in runs.jsonl), with chosen metrics and per-sample scores."""
from __future__ import annotations

import copy
import math
import os
from typing import Any, Optional

from omegaconf import OmegaConf

from kvbench.run.spec import method_evicts
from kvbench.store.folder import RunFolder
from kvbench.store.naming import config_hash, run_id_for

STREAMING_PAPER = {
    "source": "StreamingLLM, Table 2", "model": "meta-llama/Llama-2-7b-hf", "dataset": "PG19", "metric": "ppl",
    "lower_is_better": True,
    "rows": [{"label": f"{s} sinks", "match": {"method.sinks": s}, "value": v}
             for s, v in ((0, 3359.95), (1, 11.88), (4, 9.59))],
}


def config(*, method: str = "full", budget: Optional[int] = None, task: str = "perplexity",
           method_options: Optional[dict] = None, quant: Optional[dict] = None, task_options: Optional[dict] = None,
           experiment: Optional[str] = None, paper: Optional[dict] = None, model_path: Optional[str] = None,
           block_size: int = 16, seed: int = 0, compression_ratio: Optional[float] = None) -> dict:
    return {
        "model": {"name": "smollm2-135m" if model_path is None else None, "path": model_path, "gguf_file": None,
                  "dtype": "float32", "device": "cpu", "cache_dir": None},
        "method": {"name": method, **(method_options or {})},
        "quant": quant or {"name": "none"},
        "task": {"name": task, **(task_options or {})},
        "runtime": {"block_size": block_size, "num_blocks": None, "kv_memory_bytes": None,
                    "prefill_chunk_size": 512, "batch_size": 1, "attention_backend": "auto", "threads": None},
        "logger": {"wandb": False}, "budget": budget, "compression_ratio": compression_ratio, "seed": seed,
        "results_dir": "results", "rerun": False,
        "progress": False, "experiment": experiment, "paper": paper,
    }


def ppl_samples(nlls: list[float], tokens: int = 256, windows: int = 0, spread: float = 0.3) -> list[dict]:
    """One perplexity sample per document nll; with `windows` (even), the document's window_nll_sum /
    window_tokens as tasks/perplexity.py writes them: windows alternately `spread` above and below the nll."""
    out = []
    for i, nll in enumerate(nlls):
        s = {"id": f"doc{i}", "dataset": "pg_essays", "prompt": None, "prediction": None, "references": [],
             "num_tokens": tokens, "nll": nll, "ppl": math.exp(nll)}
        if windows:
            size = tokens // windows
            s["window_nll_sum"] = [(nll + (spread if w % 2 == 0 else -spread)) * size for w in range(windows)]
            s["window_tokens"] = [size] * windows
        out.append(s)
    return out


def ppl_of(samples: list[dict]) -> float:
    tot = sum(s["nll"] * s["num_tokens"] for s in samples) / sum(s["num_tokens"] for s in samples)
    return math.exp(tot)


def score_samples(scores: list[float], dataset: str = "needle") -> list[dict]:
    return [{"id": f"{dataset}-{i}", "dataset": dataset, "prompt": "p", "prediction": "x", "references": ["y"],
             "score": s} for i, s in enumerate(scores)]


def write_run(results_dir: str, cfg: dict, metrics: dict, samples: list[dict], *, commit: str = "c0ffee01",
              finished_at: str = "2026-11-30T10:00:00+00:00", status: str = "ok",
              extra_files: Optional[dict[str, bytes]] = None) -> dict:
    """Write one run folder (and its runs.jsonl line) as app.run does; returns the metrics record."""
    hashable = {k: copy.deepcopy(cfg[k]) for k in ("model", "method", "quant", "task", "runtime", "budget", "seed")}
    if cfg.get("compression_ratio") is not None:  # as kvbench.run.config.hashable_config: only a set ratio is hashed
        hashable["compression_ratio"] = cfg["compression_ratio"]
    run_id = run_id_for(hashable)
    folder = RunFolder(results_dir, run_id)
    folder.start(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    folder.write_samples(samples)
    for name, data in (extra_files or {}).items():
        with open(folder.file(name), "wb") as f:
            f.write(data)
    record: dict[str, Any] = {
        "run_id": run_id, "status": status, "error": None if status == "ok" else "RuntimeError: boom",
        "model": cfg["model"]["name"] or os.path.basename(cfg["model"]["path"]), "method": cfg["method"]["name"],
        "budget": cfg["budget"], "compression_ratio": cfg.get("compression_ratio"),
        "evicts": method_evicts(cfg["method"]["name"]), "quant": cfg["quant"]["name"], "task": cfg["task"]["name"],
        "seed": cfg["seed"],
        "device": "cpu", "dtype": "float32", "num_samples": len(samples), "config_hash": config_hash(hashable),
        "run_dir": folder.path, "experiment": cfg.get("experiment"),
        "kvbench": "0.1.0", "torch": "2.13.0", "transformers": "5.24.0", "git_commit": commit,
        "started_at": finished_at, "finished_at": finished_at, "wall_s": 1.0,
        **{f"method_{k}": v for k, v in cfg["method"].items() if k != "name"},
        **metrics,
    }
    return folder.finish(record)
