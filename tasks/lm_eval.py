"""`task=lm_eval`: lm-eval-harness tasks run through kvbench's lm-eval model (kvbench.tasks._lm_eval_lm.EngineLM) on the
run's engine, so the method and budget apply to both log-likelihood scoring and generation.

    python -m kvbench task=lm_eval task.tasks=[arc_easy,hellaswag] task.limit=100 method=... budget=...
    python -m kvbench task=lm_eval task.include_path=my_tasks/ task.tasks=[my_task]
    python -m kvbench task=lm_eval task.tasks=[kvbench_essays_mc] task.include_defaults=false   # offline example

Options:
- tasks          lm-eval task or group names (a list, or one comma-separated string); required
- include_path   folder(s) with task YAMLs of your own (lm-eval's --include_path)
- include_defaults  false = only the tasks under include_path (skips indexing lm-eval's ~15k built-in tasks, ~10 s)
- limit          at most this many documents per task (a fraction < 1 is a share of them); null = all
- num_fewshot    null = each task's default
- apply_chat_template, fewshot_as_multiturn, system_instruction   as lm-eval's options of the same names
- gen_kwargs     generation settings for generate_until tasks (dict or "k=v,k=v"), as lm-eval's --gen_kwargs
- max_gen_toks   default max new tokens of generate_until requests that do not set one
- bootstrap_iters  for lm-eval's stderr figures (0 = none, the default: faster)
- log_samples    keep lm-eval's per-document records as kvbench samples

Metrics: every lm-eval result as `<task>/<metric>` (`<task>/<metric>/<filter>` for filters other than "none"),
`<task>/<metric>_stderr` when bootstrap_iters > 0, `score`, the mean over the requested tasks of each one's primary
metric (the first of its metric_list: acc for multiple choice), and `score_metric` naming them. Samples: id `<task>/<doc_id>`, dataset = task, prompt = the first request's context, prediction = the
filtered response(s), references = [target], and lm-eval's per-document metrics. Perf: the adapter's timing
(loglikelihood scoring counts as prefill), and the engine's peak KV bytes. The seed is cfg.seed.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

from kvbench.errors import UserError
from kvbench.runtime.model import distributed
from kvbench.tasks._generation import batch_size_of
from kvbench.tasks.base import Task, TaskResult, register_task
import kvbench

INSTALL_HINT = "pip install 'lm-eval>=0.4.13,<0.5'"
# lm-eval tasks shipped with kvbench (always on the include path): kvbench_essays_mc, offline multiple choice
BUNDLED_TASKS = Path(kvbench.__file__).resolve().parent / "lm_eval_tasks"
_MANAGERS: dict = {}  # (include_path, include_defaults) -> lm-eval TaskManager, built once per process


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = value.split(",")
    return [str(v).strip() for v in value if str(v).strip()]


@dataclass
class LmEvalOptions:
    name: str = "lm_eval"
    tasks: Union[list, str, None] = field(default_factory=list)
    include_path: Union[list, str, None] = None
    include_defaults: bool = True
    limit: Optional[float] = None
    num_fewshot: Optional[int] = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    system_instruction: Optional[str] = None
    gen_kwargs: Any = None
    max_gen_toks: int = 256
    bootstrap_iters: int = 0
    log_samples: bool = True

    def __post_init__(self) -> None:
        self.tasks = _names(self.tasks)
        if not self.tasks:
            raise UserError("task=lm_eval needs task.tasks=[name,...]: lm-eval task or group names, or tasks "
                            "defined by YAML files under task.include_path")
        if self.include_path is not None:
            paths = [self.include_path] if isinstance(self.include_path, str) else list(self.include_path)
            self.include_path = [str(p) for p in paths]
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, (int, float))
                                       or self.limit <= 0):
            raise UserError(f"invalid task.limit={self.limit!r}: expected a number > 0 or null")
        if self.limit is not None and float(self.limit).is_integer() and self.limit >= 1:
            self.limit = int(self.limit)
        for key in ("num_fewshot", "bootstrap_iters"):
            v = getattr(self, key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise UserError(f"invalid task.{key}={v!r}: expected an integer >= 0" +
                                (" or null" if key == "num_fewshot" else ""))
        if isinstance(self.max_gen_toks, bool) or not isinstance(self.max_gen_toks, int) or self.max_gen_toks < 1:
            raise UserError(f"invalid task.max_gen_toks={self.max_gen_toks!r}: expected an integer >= 1")


def _metric_key(task: str, metric: str) -> Optional[str]:
    name, _, filt = metric.partition(",")
    if name == "alias" or name == "samples":
        return None
    return f"{task}/{name}" if filt in ("", "none") else f"{task}/{name}/{filt}"


_NOT_SCORES = ("sample_len", "samples", "alias")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


def primary_metric(results: dict, task: str) -> Optional[tuple[str, float]]:
    """(result key, value) of a task's primary metric: the first metric of its config's metric_list (acc for a
    multiple-choice task), at the first filter reported for it; else the first numeric metric that is a score
    (not sample_len, not a stderr)."""
    values = (results.get("results") or {}).get(task) or {}
    config = (results.get("configs") or {}).get(task) or {}
    listed = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    names = [n for n in listed if isinstance(n, str)] + [k.partition(",")[0] for k in values]
    for name in names:
        if name in _NOT_SCORES or name.endswith("_stderr"):
            continue
        for key, value in values.items():
            if key.partition(",")[0] == name and _is_number(value):
                return key, float(value)
    return None


def flatten_results(results: dict, requested: list[str]) -> dict:
    """lm-eval's results[task][metric,filter] as flat `<task>/<metric>[/<filter>]` keys, plus `score` (the mean of
    the requested tasks' primary metrics) and `score_metric` (which ones, e.g. "arc_easy/acc")."""
    metrics: dict = {}
    for task, values in (results.get("results") or {}).items():
        for metric, value in values.items():
            key = _metric_key(task, metric)
            if key is not None and _is_number(value):
                metrics[key] = float(value)
    tasks = [t for t in requested if t in (results.get("results") or {})] or list(results.get("results") or {})
    chosen = [(t, primary_metric(results, t)) for t in tasks]
    chosen = [(t, p) for t, p in chosen if p is not None]
    metrics["score"] = sum(p[1] for _, p in chosen) / len(chosen) if chosen else None
    metrics["score_metric"] = ",".join(_metric_key(t, p[0]) or t for t, p in chosen) or None
    return metrics


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _doc_order(doc_id: Any) -> tuple:
    return (0, doc_id, "") if isinstance(doc_id, int) else (1, 0, str(doc_id))


def sample_records(results: dict) -> list[dict]:
    """kvbench sample records from lm-eval's logged samples."""
    out = []
    for task, rows in (results.get("samples") or {}).items():
        # one process logs a task's samples filter by filter, each in document order; a data-parallel launch
        # gathers them rank by rank: the same order either way
        filters = list(dict.fromkeys(row.get("filter") for row in rows))
        rows = sorted(rows, key=lambda row: (filters.index(row.get("filter")), _doc_order(row.get("doc_id"))))
        for row in rows:
            args = row.get("arguments") or []
            prompt = args[0][0] if args and isinstance(args[0], (list, tuple)) and args[0] else None
            resps = row.get("filtered_resps")
            prediction = resps[0] if isinstance(resps, list) and len(resps) == 1 else resps
            rec = {
                "id": f"{task}/{row.get('doc_id')}", "dataset": task, "prompt": prompt,
                "prediction": _jsonable(prediction), "references": [_jsonable(row.get("target"))],
                "filter": row.get("filter"),
            }
            for m in row.get("metrics") or []:
                rec[m] = _jsonable(row.get(m))
            out.append(rec)
    return out


def seed_of(settings: Any) -> int:
    """The run's seed from the typed Settings (settings.seed), an old-style DictConfig or a dict; 0 if none."""
    seed = getattr(settings, "seed", None)
    if seed is None and isinstance(settings, dict):
        seed = settings.get("seed")
    try:
        return int(seed) if seed is not None else 0
    except (TypeError, ValueError):
        return 0


# lm-eval's modules that draw tqdm bars of their own (building contexts, tokenizing inputs)
_LM_EVAL_BAR_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.evaluator")


@contextlib.contextmanager
def quiet_lm_eval() -> Iterator[None]:
    """Keep lm-eval's own output out of kvbench's: its tqdm bars are off, its log records go to the run's
    kvbench.log only (Hydra's file handler; nowhere when there is none) and its `git describe` (for a commit hash
    kvbench records itself) asks git without letting git's "fatal: not a git repository" through."""
    import importlib
    import subprocess

    patched: list = []

    def patch(module: Any, name: str, value: Any) -> None:
        patched.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def no_bar(real: Any) -> Any:
        def bar(*args: Any, **kwargs: Any) -> Any:
            return real(*args, **{**kwargs, "disable": True})  # whatever disable= lm-eval passes
        return bar

    for name in _LM_EVAL_BAR_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "tqdm"):
            patch(module, "tqdm", no_bar(module.tqdm))
    evaluator = importlib.import_module("lm_eval.evaluator")
    if hasattr(evaluator, "get_git_commit_hash"):
        def quiet_git_hash() -> Optional[str]:
            try:
                out = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=5,
                                     stdin=subprocess.DEVNULL)
                return out.stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                return None
        patch(evaluator, "get_git_commit_hash", quiet_git_hash)
    lm_log = logging.getLogger("lm_eval")
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    saved = (lm_log.propagate, list(lm_log.handlers))
    lm_log.propagate = False
    for h in files:
        lm_log.addHandler(h)
    if not files:
        lm_log.addHandler(logging.NullHandler())
    try:
        yield
    finally:
        lm_log.propagate, lm_log.handlers[:] = saved[0], saved[1]
        for module, name, value in reversed(patched):
            setattr(module, name, value)


@register_task("lm_eval")
class LmEval(Task):
    Options = LmEvalOptions
    workload_known_late = True  # lm-eval builds its requests (documents, few-shot contexts) after the model loads

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: lm-eval must be installed (found without importing it)."""
        import importlib.util

        try:
            found = importlib.util.find_spec("lm_eval") is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"task=lm_eval needs lm-eval, which is not installed: {INSTALL_HINT}")
        self._check_known(self._manager())  # an unknown task name: refused before the model loads

    def _manager(self) -> Any:
        """lm-eval's TaskManager over task.include_path and the bundled tasks, built once per process for each
        include path (indexing lm-eval's built-in tasks takes seconds: preflight and run share it)."""
        opts = self.options
        key = (tuple(opts.include_path or ()), bool(opts.include_defaults))
        if key not in _MANAGERS:
            try:
                from lm_eval.tasks import TaskManager
            except ImportError as exc:
                raise UserError(f"task=lm_eval needs lm-eval ({INSTALL_HINT}): {exc}") from None
            with quiet_lm_eval():
                _MANAGERS[key] = TaskManager(include_path=[*key[0], str(BUNDLED_TASKS)], include_defaults=key[1])
        return _MANAGERS[key]

    def _check_known(self, manager: Any) -> None:
        opts = self.options
        unknown = [t for t in opts.tasks if not manager.match_tasks([t]) and not os.path.isfile(t)]
        if unknown:
            raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}"
                            + (f" (include_path {', '.join(opts.include_path)})" if opts.include_path else
                               " (lm_eval ls tasks lists them; task.include_path adds your own YAMLs)"))

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        try:
            import lm_eval

            from kvbench.tasks._lm_eval_lm import EngineLM
        except ImportError as exc:
            raise UserError(f"task=lm_eval needs lm-eval ({INSTALL_HINT}): {exc}") from None
        seed = seed_of(cfg)
        lm = EngineLM(engine, tokenizer, batch_size=batch_size_of(cfg),
                      max_gen_toks=opts.max_gen_toks, seed=seed, progress=progress, announce=self.announce)
        manager = self._manager()
        self._check_known(manager)
        with quiet_lm_eval():  # lm-eval's logs and bars stay out of kvbench's output
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(opts.tasks), num_fewshot=opts.num_fewshot, limit=opts.limit,
                task_manager=manager, bootstrap_iters=opts.bootstrap_iters, log_samples=opts.log_samples,
                apply_chat_template=opts.apply_chat_template, fewshot_as_multiturn=opts.fewshot_as_multiturn,
                system_instruction=opts.system_instruction, gen_kwargs=opts.gen_kwargs,
                random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            )
        if distributed.current() is not None:  # lm-eval returns the results on data-parallel rank 0 only
            results = distributed.broadcast_object(results)
        if results is None:  # pragma: no cover
            raise UserError("lm-eval returned no results")
        metrics = flatten_results(results, opts.tasks)
        samples = sample_records(results) if opts.log_samples else []
        perf = lm.perf()
        if distributed.current() is not None:
            perf["samples_computed"] = lm.requests_served  # this rank's share of the requests
        return TaskResult(metrics=metrics, samples=samples, perf=perf)
