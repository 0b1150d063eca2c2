"""Tasks, one module each, registered by their config name (`task=<name>`)."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from kvbench.errors import UserError
from tasks.base import TASKS, Task, TaskResult, make_progress, no_progress, register_task

__all__ = ["Task", "TaskResult", "register_task", "build_task", "available_tasks", "make_progress",
           "no_progress", "TASKS"]


def _load_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


def available_tasks() -> list[str]:
    _load_all()
    return sorted(TASKS)


def build_task(name: str, cfg: Any = None) -> Task:
    """The task registered as `name`, with its options validated from cfg (a dict or DictConfig of the task
    section; a `name` key in it is allowed). Unknown names or options raise UserError naming the choices."""
    choices = available_tasks()
    if name not in TASKS:
        raise UserError(f"unknown task '{name}': choices are {', '.join(choices)}")
    values: dict = {}
    if cfg is not None:
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        values = dict(cfg)
    cls = TASKS[name]
    values.setdefault("name", name)
    return cls(cls.make_options(values))
