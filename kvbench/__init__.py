"""kvbench: a KV-cache compression benchmark on one paged runtime."""

from kvbench.runtime.threads import apply_wait_policy as _apply_wait_policy

# OpenMP reads its waiting policy once, when torch loads libgomp: set it before anything imports torch
# (kvbench/runtime/threads.py explains the measurement behind it).
_apply_wait_policy()

__version__ = "0.1.0"
