"""Tasks, one module each, registered by their config name (`task=<name>`)."""
from __future__ import annotations

from typing import Any

from kvbench.errors import UserError
from kvbench.tasks.base import TASKS, Task, TaskResult, make_progress, no_progress, register_task

__all__ = ["Task", "TaskResult", "register_task", "build_task", "available_tasks", "make_progress",
           "no_progress", "TASKS"]


def available_tasks() -> list[str]:
    return TASKS.names()


def build_task(name: str, cfg: Any = None) -> Task:
    """The task registered as `name`, with its options validated from cfg (a dict or DictConfig of the task
    section; a `name` key in it is allowed). Unknown names or options raise UserError naming the choices."""
    cls = TASKS.get(name)
    values: dict = {}
    if cfg is not None:
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        values = dict(cfg)
    values.setdefault("name", name)
    return cls(cls.make_options(values))
