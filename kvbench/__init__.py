"""kvbench: a KV-cache compression benchmark on one paged runtime."""

from kvbench.runtime.backends.cpu.threads import apply_wait_policy as _apply_wait_policy

# OpenMP reads its waiting policy once, when torch loads libgomp: set it before anything imports torch
# (kvbench/runtime/backends/cpu/threads.py explains why).
_apply_wait_policy()

__version__ = "0.1.0"

# The Python API (kvbench/api.py), imported on first use so that `import kvbench` (and the CLI's start) stays light.
_API = ("evaluate", "pipeline", "load_runs", "Results", "Pipeline")


def __getattr__(name: str):
    if name in _API:  # PEP 562: loaded by name on first use (kvbench.api imports the app, which reads __version__)
        import importlib

        return getattr(importlib.import_module("kvbench.api"), name)
    raise AttributeError(f"module 'kvbench' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
