"""kvbench in lm-eval's own command line: `lm_eval --model kvbench --model_args method=snapkv,budget=64 --tasks
kvbench_essays_mc`, with no --include_path.

lm-eval 0.4.13 reads no plugin entry points: its `--model` names come from its own registry and its tasks from its
own folder plus --include_path. So an installed kvbench ships `kvbench-lm-eval.pth` (setup.py puts it into the
wheel and the editable install), which Python's site module runs at start-up: it loads this file by path, under the
name `_kvbench_lm_eval_hook`, without importing kvbench (nothing of kvbench or torch is loaded by a Python that never
imports lm-eval). This file imports nothing but the standard library; when lm-eval's modules are imported it adds:

- after `lm_eval.api.registry`: the model "kvbench", as a lazy placeholder for kvbench.commands.lm_eval_adapter:KVBenchLM
  (the adapter is imported only when lm-eval builds that model); lm-eval's own models are registered first, as
  `get_model` would (it imports them only into an empty registry);
- after `lm_eval.tasks.manager`: kvbench's packaged task folder (kvbench/lm_eval_tasks: kvbench_essays_mc) before
  the caller's include_path in every TaskManager that includes lm-eval's built-in tasks (so a user's own folder
  still overrides a task of the same name); a TaskManager built with include_defaults=False gets only what it asks.

A failure here is a one-line warning on stderr, never a failure of the program that imported lm-eval.
"""
from __future__ import annotations

import functools
import importlib.abc
import inspect
import os
import sys
from typing import Any, Callable

MODEL_NAME = "kvbench"
MODEL_TARGET = "kvbench.commands.lm_eval_adapter:KVBenchLM"
TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "lm_eval_tasks")
PTH_FILE = "kvbench-lm-eval.pth"


def register_model(registry: Any) -> None:
    """Add the kvbench model (lazy) to lm-eval's model registry, after lm-eval's own models."""
    import lm_eval.models  # noqa: F401  (lm-eval's models: get_model imports them only into an empty registry)

    if MODEL_NAME not in registry.model_registry:
        registry.model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def add_task_dir(manager: Any) -> None:
    """Make every TaskManager that includes lm-eval's built-in tasks index kvbench's packaged tasks too."""
    cls = manager.TaskManager
    original = cls.__init__
    if getattr(original, "_kvbench_tasks", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("include_defaults", True):
            given = bound.arguments.get("include_path")
            paths = [] if not given else list(given) if isinstance(given, (list, tuple)) else [given]
            if not any(os.path.realpath(str(p)) == TASKS_DIR for p in paths):
                bound.arguments["include_path"] = [TASKS_DIR, *paths]
        original(*bound.args, **bound.kwargs)

    __init__._kvbench_tasks = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


AFTER_IMPORT: dict[str, Callable[[Any], None]] = {"lm_eval.api.registry": register_model,
                                                  "lm_eval.tasks.manager": add_task_dir}


class LmEvalImportHook(importlib.abc.MetaPathFinder):
    """Finds the modules of AFTER_IMPORT with the other finders and runs their step after the module executed."""

    kvbench_lm_eval_hook = True

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        step = AFTER_IMPORT.get(name)
        if step is None:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                step(module)
            except Exception as exc:  # lm-eval still works, without kvbench in it
                print(f"kvbench: could not add kvbench to lm-eval ({name}): {type(exc).__name__}: {exc}",
                      file=sys.stderr)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put the hook first on sys.meta_path (once per process); if lm-eval's modules are already imported, their
    steps run now."""
    if any(getattr(f, "kvbench_lm_eval_hook", False) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, LmEvalImportHook())
    for name, step in AFTER_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            step(module)


def pth_line() -> str:
    """The one line of kvbench-lm-eval.pth: find the kvbench package without importing it, load this file by path
    and install the hook; silent when kvbench or this file is not there."""
    return ("import importlib.util as u, os, sys; s = u.find_spec('kvbench'); "
            "f = s and s.submodule_search_locations and os.path.join(list(s.submodule_search_locations)[0], "
            "'commands', 'lm_eval_hook.py'); h = f and os.path.isfile(f) and "
            "u.spec_from_file_location('_kvbench_lm_eval_hook', f); "
            "m = h and u.module_from_spec(h); m and (sys.modules.setdefault('_kvbench_lm_eval_hook', m), "
            "h.loader.exec_module(m), m.install())\n")
