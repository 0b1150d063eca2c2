"""kvbench from Python: `evaluate` (a run, as `python -m kvbench` makes it), `pipeline` (kvpress's shape: one
context and question through a compression method), `load_runs` (results folders as run records).

    import kvbench
    res = kvbench.evaluate(method="snapkv", budget=64, task="needle", results_dir=None,
                           **{"task.lengths": [512], "task.depths": [50]})
    res.metrics["accuracy"], res.samples[0]["prediction"], res.to_pandas()

    pipe = kvbench.pipeline()                     # the packaged SmolLM2-135M-Instruct, loaded once
    out = pipe(context, question="...", method="snapkv", compression_ratio=0.5, max_new_tokens=32)
    out["answer"], out["kept_tokens"], out["held_kv_bytes"], out["peak_kv_bytes"]

Both compose the run config through Hydra's compose API from the same overrides the command line would get, and
check it with the same rules (kvbench.run.plan.plan_run): bad input raises one ValueError naming the value and the
choices, before the model loads. evaluate runs kvbench.run.app.run, so a run made here is the run the CLI makes: the same
run id, folder, metrics.json, samples.jsonl and runs.jsonl line (Hydra's own .hydra/ and kvbench.log are the CLI's
only); results_dir=None runs in a temporary folder that is removed afterwards.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import pandas as pd
import torch
from hydra import compose, initialize_config_dir

import kvbench.run.config  # noqa: F401  (registers the config schemas and resolvers)
from kvbench.run import app
from kvbench.commands.cli import describe_hydra_error
from kvbench.run.config import bool_keys, int_keys
from kvbench.console import RUN_LOG
from kvbench.run.engines import build_engine, build_run_codec
from kvbench.errors import UserError
from kvbench.run.plan import plan_run
from kvbench.runtime.backends.cpu.threads import configure_threads
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.model.quantized_weights import set_quant_activations
from kvbench.run.spec import check_bool_spellings, check_positive, integral_spellings
from kvbench.store.files import read_jsonl
from kvbench.store.folder import SAMPLES_FILE
from kvbench.store.runs import load_runs as _load_runs
from kvbench.tasks._generation import (GenRequest, apply_chat, encode, kept_stats, run_generation, split_prompt,
                                       split_question, stop_token_ids, wants_chat_template)

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "conf")
GROUPS = ("model", "method", "quant", "task", "runtime", "logger")
_PLAIN = re.compile(r"^[\w./:@+-]+$")  # an override value Hydra reads as written (no quoting needed)
_KEEP = object()  # results_dir not given: the config's default


# =========================================================================== overrides
def _value(v: Any) -> str:
    """A Python value as Hydra's override grammar writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_value(x)}" for k, x in v.items()) + "}"
    s = str(v)
    if _PLAIN.match(s) and s.lower() not in ("null", "true", "false"):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def to_overrides(options: dict) -> list[str]:
    """Keyword arguments as command-line overrides: `method="snapkv"` -> `method=snapkv`, `budget=None` ->
    `budget=null`; a dict value sets that section's keys (`task={"limit": 1}` -> `task.limit=1`); a dotted name
    sets one key (`**{"task.limit": 1}`)."""
    out = []
    for key, v in options.items():
        if isinstance(v, dict) and "." not in key:
            out += [f"{key}.{k}={_value(x)}" for k, x in v.items()]
        else:
            out.append(f"{key}={_value(v)}")
    return out


def compose_config(overrides: Iterable[str]) -> Any:
    """The run config `python -m kvbench <overrides>` composes (the hydra node left out), with the CLI's spelling
    checks first; bad input: ValueError with the CLI's one line."""
    overrides = list(overrides)
    try:
        check_bool_spellings(overrides, bool_keys())
        overrides = integral_spellings(overrides, int_keys())
    except UserError as exc:
        raise ValueError(str(exc)) from None
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="kvbench"):
            return compose(config_name="config", overrides=overrides)
    except Exception as exc:
        message = describe_hydra_error(exc)
        if message is None:
            raise
        raise ValueError(message) from None


# =========================================================================== evaluate
@dataclass
class Results:
    """One run's outcome: `metrics` (metrics.json's record), `samples` (samples.jsonl's records) and `run_dir` (its
    folder; None when it ran with results_dir=None)."""

    metrics: dict
    samples: list = field(default_factory=list)
    run_dir: Optional[str] = None

    def __getitem__(self, key: str) -> Any:
        return self.metrics[key]

    def to_pandas(self, samples: bool = True) -> Any:
        """samples=True: one row per sample, led by the run's run_id, model, method, budget, compression_ratio and
        task; samples=False: one row, the metrics record (the row load_runs gives this run)."""
        if not samples:
            return pd.DataFrame([self.metrics])
        ident = {k: self.metrics.get(k) for k in ("run_id", "model", "method", "budget", "compression_ratio", "task")}
        return pd.DataFrame([{**ident, **s} for s in self.samples])


def evaluate(method: Optional[str] = None, task: Optional[str] = None, model: Optional[str] = None, *,
             results_dir: Any = _KEEP, overrides: Iterable[str] = (), print_summary: bool = False,
             **options: Any) -> Results:
    """Run one config as `python -m kvbench` would and return its Results.

    method / task / model pick the group options (None: the config's default); options are any other overrides as
    keywords (`budget=64`, `compression_ratio=0.5`, `seed=1`, `task={"limit": 1}`, `**{"task.max_tokens": 256}`);
    `overrides` takes command-line strings as they are (`["task.lengths=[512]"]`). results_dir: where the run
    folder goes (default: the config's `results`), None: a temporary folder, removed afterwards. A finished run
    with the same config in results_dir is not run again (its stored results come back), unless rerun=True.
    Bad input: ValueError (one line naming the value and the choices); a run that fails: RuntimeError."""
    picked = {"method": method, "task": task, "model": model}
    args = to_overrides({k: v for k, v in picked.items() if v is not None}) + to_overrides(options)
    args += list(overrides)
    scratch = tempfile.mkdtemp(prefix="kvbench-api-") if results_dir is None else None
    if results_dir is not _KEEP:
        args.append(f"results_dir={_value(scratch or os.fspath(results_dir))}")
    try:
        cfg = compose_config(args)
        was_disabled = RUN_LOG.disabled
        try:
            record = app.run(cfg, print_summary=print_summary)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        finally:
            RUN_LOG.disabled = was_disabled
        if record.get("status") == "claimed":
            raise RuntimeError(f"run {record.get('run_id')} is being run by another process "
                               f"(pid {record.get('holder', {}).get('pid')}); try again when it has finished")
        run_dir = record.get("run_dir")
        if record.get("status") != "ok":
            raise RuntimeError(f"run {record.get('run_id')} failed: {record.get('error')}"
                               + (f" (details in {run_dir}/error.txt)" if scratch is None and run_dir else ""))
        path = os.path.join(run_dir, SAMPLES_FILE) if run_dir else None
        samples = read_jsonl(path) if path and os.path.isfile(path) else []
        return Results(metrics=record, samples=samples, run_dir=None if scratch else run_dir)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


# =========================================================================== pipeline
class Pipeline:
    """kvpress's pipeline shape over kvbench's runtime: the model loaded once, then
    `pipe(context, question=..., method=..., budget=... | compression_ratio=..., max_new_tokens=...)`.

    Each call builds the method and the engine as a run does (kvbench.run.plan.plan_run over the composed config, then
    kvbench.run.engines), templates the prompt with the model's chat template (when it has one; `system_prompt` as a
    system turn), prefills the context, lets the method compress it, appends the question uncompressed (kvpress's
    protocol; `compress_question=True`: the question is compressed with it and the turn's end appended after, as
    kvpress's query-aware loop) and decodes greedily."""

    def __init__(self, model: Optional[str] = None, overrides: Iterable[str] = (), **options: Any):
        self._model_args = _model_overrides(model) + to_overrides(options) + list(overrides)
        plan = _plan(self._model_args)
        m = plan.settings.model
        self.device = plan.device
        self.loaded = load_model(m.path, gguf_file=m.gguf_file, dtype=m.dtype, device=plan.device,
                                 cache_dir=m.cache_dir, weights=m.weights)
        set_quant_activations(self.loaded.model, m.quant_activations)
        self.tokenizer = self.loaded.tokenizer
        try:  # as the app does: codecs that calibrate and methods with per-model files read these
            self.loaded.model.tokenizer = self.tokenizer
            self.loaded.model.name_or_path = m.path
        except AttributeError:
            pass

    def __call__(self, context: str, question: str = "", *, method: str = "full", budget: Optional[int] = None,
                 compression_ratio: Optional[float] = None, max_new_tokens: int = 50,
                 system_prompt: Optional[str] = None, compress_question: bool = False, chat_template: str = "auto",
                 quant: Optional[str] = None, seed: int = 0, **method_options: Any) -> dict:
        """The answer and the cache's figures: {"answer", "prompt_tokens", "kept_tokens" (per layer and kv-head
        after compression, mean), "kv_kept_fraction", "held_kv_bytes" (the tables' bytes when the uncompressed
        cache would have peaked), "peak_kv_bytes" (the pool's peak), "full_kv_bytes" (an uncompressed cache's)}."""
        if not isinstance(context, str) or not context:
            raise ValueError(f"invalid context={context!r}: expected a non-empty string")
        if not isinstance(question, str):
            raise ValueError(f"invalid question={question!r}: expected a string")
        try:
            check_positive("max_new_tokens", max_new_tokens)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        args = self._model_args + to_overrides({"method": method, "budget": budget,
                                                "compression_ratio": compression_ratio, "seed": seed})
        if quant is not None:
            args += to_overrides({"quant": quant})
        args += [f"method.{k}={_value(v)}" for k, v in method_options.items()]
        plan = _plan(args)
        s = plan.settings
        tok = self.tokenizer
        try:
            chat = wants_chat_template(chat_template, tok)
        except UserError as exc:
            raise ValueError(str(exc).replace("task.chat_template", "chat_template")) from None
        user = f"{context}\n\n{question}" if question else context
        prompt = apply_chat(tok, user, system_prompt) if chat else user
        tail = asked = 0
        start = prompt.rfind(question) if question else -1
        if start >= 0 and not compress_question:  # the question (and the turn's end) appended uncompressed
            ids, tail = split_prompt(tok, prompt, start, chat)
        elif start >= 0:  # kvpress's query-aware loop: context and question compressed, the turn's end after
            ids, asked, tail = split_question(tok, prompt, start, start + len(question), chat)
        else:
            ids = encode(tok, prompt, chat)
        configure_threads(s.runtime.threads)
        torch.manual_seed(s.seed)
        codec = build_run_codec(s.quant_name, s.quant_options, self.loaded.model, tok)
        try:
            engine = build_engine(s.runtime, self.loaded.model, plan.method, codec=codec)
        except ValueError as exc:
            raise ValueError(f"invalid runtime settings: {exc}") from None
        request = GenRequest(id="pipeline", dataset=None, prompt=prompt, token_ids=ids,
                             max_new_tokens=max_new_tokens, stop_ids=stop_token_ids(tok), uncompressed_tail=tail,
                             question_tokens=asked)
        try:
            outputs, _ = run_generation(engine, tok, [request])
        except UserError as exc:
            raise ValueError(str(exc)) from None
        out = outputs[0]
        mem, kept = engine.memory_stats(), kept_stats(engine)
        kept_tokens = kept.get("kv_tokens_kept_mean")
        return {"answer": out.prediction, "prompt": prompt, "finish_reason": out.finish_reason,
                "prompt_tokens": len(ids),
                "kept_tokens": (kept_tokens + tail) if kept_tokens is not None else len(ids),
                "kv_kept_fraction": kept.get("kv_kept_fraction", out.kv_kept_fraction),
                "held_kv_bytes": mem.get("held_kv_bytes"), "peak_kv_bytes": mem.get("peak_kv_bytes"),
                "full_kv_bytes": mem.get("full_kv_bytes"), "method": s.method_name, "budget": s.budget,
                "compression_ratio": s.compression_ratio}


def _model_overrides(model: Optional[str]) -> list[str]:
    """`model` as overrides: a preset of conf/model (smollm2-135m, gemma-3-1b, ...) by name, anything else a hub id
    or a local folder (model=hf model.path=...); None: the default (the packaged SmolLM2-135M-Instruct)."""
    if model is None:
        return []
    if not isinstance(model, str) or not model:
        raise ValueError(f"invalid model={model!r}: expected a preset name, a hub id or a local folder")
    presets = sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, "model")) if f.endswith(".yaml"))
    if model in presets and model != "hf":
        return [f"model={model}"]
    if "/" in model or os.path.isdir(model):
        return ["model=hf", f"model.path={_value(model)}"]
    raise ValueError(f"unknown model '{model}': choices are {', '.join(p for p in presets if p != 'hf')}, "
                     f"a hub id (org/name) or a local folder")


def _plan(args: list) -> Any:

    cfg = compose_config(["logger.wandb=false", *args])
    try:
        return plan_run(cfg)
    except UserError as exc:
        raise ValueError(str(exc)) from None


def pipeline(model: Optional[str] = None, **options: Any) -> Pipeline:
    """A Pipeline over `model` (a conf/model preset, a hub id or a local folder; default the packaged
    SmolLM2-135M-Instruct); options are overrides of the model and runtime sections (`runtime={"threads": 1}`)."""
    return Pipeline(model, **options)


# =========================================================================== load_runs
def load_runs(results_dirs: Any, **kwargs: Any) -> list[dict]:
    """kvbench.store.runs.load_runs over one results folder or a list of them (their runs, in order)."""

    return _load_runs(results_dirs, **kwargs)
