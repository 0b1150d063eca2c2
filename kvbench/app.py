"""One run: build model, method, engine and task from the config, execute, record results, log to W&B.

    python -m kvbench ...           -> kvbench.__main__ -> app.main(cfg) -> app.run(cfg)

run() raises UserError for bad input found before any work (the CLI prints one line and exits 2). Once the run
has started, every failure is recorded in the run folder with status "failed" and its error; a sweep goes on with
the next run, and the process exits non-zero at the end (2 if any run had bad input, else 1).
"""
from __future__ import annotations

import datetime as _dt
import os
import random
import subprocess
import time
import traceback
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

import kvbench
from kvbench import config as _config
from kvbench.errors import UserError, report
from kvbench.results import RunFolder, config_hash, run_id_for
from kvbench.summary import format_summary
from kvbench.wandb_logger import WandbLogger

_exit_code = 0


def exit_code() -> int:
    """0 if every run of this process succeeded; 2 if one had bad input; else 1 if one failed."""
    return _exit_code


def _note_exit(code: int) -> None:
    global _exit_code
    if code == 2 or (code == 1 and _exit_code == 0):
        _exit_code = code


def main(cfg: DictConfig) -> Optional[dict]:
    """The Hydra task function: run one config; never raises, so a sweep goes on."""
    run_dir = None
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            run_dir = HydraConfig.get().runtime.output_dir
    except Exception:  # pragma: no cover
        pass
    try:
        record = run(cfg, run_dir=run_dir)
    except UserError as exc:
        report(str(exc))
        _note_exit(2)
        if run_dir is not None:
            _discard_unstarted(run_dir)
        return None
    if record.get("status") != "ok":
        _note_exit(1)
    return record


def _discard_unstarted(run_dir: str) -> None:
    """Remove the folder Hydra made for a run refused before it started (only Hydra's own files in it)."""
    import shutil

    try:
        names = set(os.listdir(run_dir))
        if names <= {".hydra", "kvbench.log"}:
            shutil.rmtree(run_dir, ignore_errors=True)
    except OSError:
        pass


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(kvbench.__file__)))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None


def versions() -> dict:
    import torch
    import transformers

    return {"kvbench": kvbench.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "git_commit": _git_commit()}


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _method_fields(method: Any) -> dict:
    try:
        settings = method.describe()
    except Exception:
        return {}
    out = {}
    for k, v in (settings or {}).items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                out[f"method_{k}_{k2}"] = v2
        else:
            out[f"method_{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run(cfg: Any, *, run_dir: Optional[str] = None, load_model_fn: Optional[Callable] = None,
        engine_cls: Optional[type] = None, build_method_fn: Optional[Callable] = None,
        print_summary: bool = True) -> dict:
    """Execute one run and return its metrics record (also written to run_dir/metrics.json).

    load_model_fn / engine_cls / build_method_fn replace the real ones (tests use fakes)."""
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg)
    settings = _config.validate(cfg)
    from kvbench.quant.registry import check_codec, resolve_storage

    (settings.method_name, settings.method_options, settings.quant_name,
     settings.quant_options) = resolve_storage(settings.method_name, settings.method_options,
                                               settings.quant_name, settings.quant_options)
    check_codec(settings.quant_name, settings.quant_options)

    # Pure checks first, so bad input fails before anything is loaded or written.
    if build_method_fn is None:
        from methods import build_method as build_method_fn  # type: ignore[no-redef]
    from tasks import build_task

    try:
        method = build_method_fn(settings.method_name, settings.budget, seed=settings.seed,
                                 **settings.method_options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for method {settings.method_name!r}: {exc}") from None
    task = build_task(settings.task_name, {"name": settings.task_name, **settings.task_options})

    hashable = _config.hashable_config(cfg)
    run_id = run_id_for(hashable)
    if run_dir is not None:
        run_id = os.path.basename(os.path.normpath(run_dir))
    folder = RunFolder(settings.results_dir, run_id, run_dir)
    previous = None if settings.rerun else folder.finished()
    if previous is not None:
        print(f"kvbench: {run_id} already finished in {folder.path}; skipping (rerun=true to run it again)",
              flush=True)
        return previous

    resolved = OmegaConf.to_container(cfg, resolve=True)
    folder.start(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    device = _resolve_device(settings.model.device)
    record: dict = {
        "run_id": run_id, "status": "failed", "error": None,
        "model": settings.model.name, "method": settings.method_name, "budget": settings.budget,
        "quant": settings.quant_name, **{f"quant_{k}": v for k, v in settings.quant_options.items()},
        "task": settings.task_name, "seed": settings.seed, "device": device, "dtype": settings.model.dtype,
        "num_samples": 0, "config_hash": config_hash(hashable), "run_dir": folder.path,
        "started_at": _now(),
    }
    record.update(_method_fields(method))
    try:
        record.update(versions())
    except Exception:  # pragma: no cover
        pass
    logger = WandbLogger(settings.logger, run_dir=folder.path, run_id=run_id, config=resolved,
                         tags=[settings.method_name, settings.task_name, settings.model.name],
                         job_type=settings.task_name)
    logger.start()

    samples: list = []
    usage_error: Optional[UserError] = None
    t0 = time.perf_counter()
    try:
        import torch

        if settings.runtime.threads:
            torch.set_num_threads(settings.runtime.threads)
        _seed_everything(settings.seed)
        loaded = _load_model(settings, device, load_model_fn)
        if getattr(loaded, "model", None) is not None and getattr(loaded, "tokenizer", None) is not None:
            try:  # codecs that calibrate (method=kvquant) tokenize their calibration text with it
                loaded.model.tokenizer = loaded.tokenizer
            except AttributeError:
                pass
        record["model_path"] = getattr(loaded, "name", None)
        if engine_cls is None:
            from kvbench.runtime.engine import Engine as engine_cls  # type: ignore[no-redef]
        rt = settings.runtime
        codec = None
        if settings.quant_name not in ("none", "full"):
            from kvbench.quant.registry import build_codec

            quant_options = dict(settings.quant_options)
            if settings.quant_name == "kvquant" and quant_options.get("tokenizer") is None:
                quant_options["tokenizer"] = loaded.tokenizer  # calibration text is tokenized with it
            codec = build_codec(settings.quant_name, loaded.model, **quant_options)
        try:
            extra = {"codec": codec} if codec is not None else {}
            engine = engine_cls(loaded.model, method, block_size=rt.block_size, num_blocks=rt.num_blocks,
                                kv_memory_bytes=rt.kv_memory_bytes, prefill_chunk_size=rt.prefill_chunk_size,
                                attention_backend=rt.attention_backend, max_num_seqs=rt.max_num_seqs,
                                max_num_batched_tokens=rt.max_num_batched_tokens,
                                admission_watermark=rt.admission_watermark, **extra)
        except ValueError as exc:
            raise UserError(f"invalid runtime settings: {exc}") from None
        record["attention_backend"] = getattr(engine, "attention_backend", rt.attention_backend)
        cache = getattr(engine, "cache", None)
        if cache is not None and hasattr(cache, "describe_storage"):
            record.update({f"storage_{k}": v for k, v in cache.describe_storage().items()})
        from tasks import make_progress

        task.output_dir = folder.path  # where a task may save artifacts (e.g. the needle heatmap)
        result = task.run(engine, loaded.tokenizer, cfg, make_progress(settings.progress))
        samples = list(result.samples or [])
        record.update(result.metrics or {})
        for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s"):
            record[key] = (result.perf or {}).get(key, result.metrics.get(key) if result.metrics else None)
        try:
            mem = engine.memory_stats()
            for key in ("peak_kv_bytes", "full_kv_bytes", "kv_bytes_per_token"):
                record[key] = mem.get(key)
        except Exception as exc:  # pragma: no cover
            record["memory_stats_error"] = f"{type(exc).__name__}: {exc}"
        record["num_samples"] = len(samples)
        record["status"] = "ok"
    except UserError as exc:
        usage_error = exc
        record["error"] = str(exc)
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        _finish(folder, record, samples, logger, t0, print_summary)
        raise
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        folder.write_error(traceback.format_exc())
    # bad input found during the run: recorded, then reported as one line by the caller (no summary)
    record = _finish(folder, record, samples, logger, t0, print_summary and usage_error is None)
    if usage_error is not None:
        raise usage_error
    if record["status"] != "ok" and print_summary:
        report(f"run {run_id} failed: {record['error']} (traceback in {folder.file('error.txt')})")
    return record


_loaded_model: dict = {}


def _load_model(settings: _config.Settings, device: str, load_model_fn: Optional[Callable]) -> Any:
    """Load the model; the real loader's last model is kept, so a sweep over methods and budgets loads it once."""
    m = settings.model
    args = dict(gguf_file=m.gguf_file, dtype=m.dtype, device=device, cache_dir=m.cache_dir)
    if load_model_fn is not None:
        return load_model_fn(m.path, **args)
    key = (m.path, tuple(sorted(args.items())))
    if key not in _loaded_model:
        from kvbench.runtime.loading import load_model

        _loaded_model.clear()  # at most one model in memory
        _loaded_model[key] = load_model(m.path, **args)
    return _loaded_model[key]


def _finish(folder: RunFolder, record: dict, samples: list, logger: WandbLogger, t0: float,
            print_summary: bool) -> dict:
    record["wall_s"] = time.perf_counter() - t0
    record["finished_at"] = _now()
    folder.write_samples(samples)
    record = folder.finish(record)
    logger.log_result(record, samples)
    logger.finish(failed=record["status"] != "ok")
    if print_summary:
        print(format_summary(record, folder.path), flush=True)
    return record
