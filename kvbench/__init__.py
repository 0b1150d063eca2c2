"""kvbench: a KV-cache compression benchmark on one paged runtime."""

from kvbench.runtime.backends.cpu.threads import apply_wait_policy as _apply_wait_policy

# OpenMP reads its waiting policy once, when torch loads libgomp: set it before anything imports torch
# (kvbench/runtime/backends/cpu/threads.py explains why).
_apply_wait_policy()

__version__ = "0.1.0"
