"""Named fault points: where tests make a real run die or wait, with nothing in the production path but a call.

    faults.reach("before_index")                       # in the code: a no-op unless a test installed a callback
    faults.install("before_index", lambda: os._exit(9))  # in a test (the `fault_points` fixture clears it after)

Points:
  before_task    kvbench.run.app: the model and engine are loaded, the task has not run (a test sleeps here, so a run
                 can be killed or signalled mid-way cheaply)
  before_index   RunFolder.finish: metrics.json is written, its runs.jsonl line not yet (a test exits here: the
                 kill between the two writes that repair_index mends)

A subprocess test installs its callbacks in the child before the CLI starts (tests/fault_cli.py does this for the
fake CLI); nothing is read from the environment.
"""
from __future__ import annotations

from typing import Callable, Optional

POINTS = ("before_task", "before_index")
_callbacks: dict[str, list[Callable[[], None]]] = {}


def install(point: str, callback: Callable[[], None]) -> None:
    """Call `callback()` each time the code reaches `point` (one of POINTS)."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}: choices are {', '.join(POINTS)}")
    _callbacks.setdefault(point, []).append(callback)


def clear(point: Optional[str] = None) -> None:
    """Remove the callbacks of `point` (of every point when None)."""
    if point is None:
        _callbacks.clear()
    else:
        _callbacks.pop(point, None)


def reach(point: str) -> None:
    """The code is at `point`: run the callbacks a test installed there (none in a normal run)."""
    for callback in _callbacks.get(point, ()):
        callback()
