"""The Triton backend: paged attention (`attention`, behind `backend.TritonBackend`) and the dequantizer of packed
blocks (`dequant`).

Those modules import triton (an optional dependency) and define @triton.jit kernels, which read TRITON_INTERPRET
when they are defined: they are imported only once chosen, through `load` (set TRITON_INTERPRET=1 before that on a
machine without a GPU, as the tests do). This package itself imports neither triton nor torch.
"""
from __future__ import annotations

import importlib
from types import ModuleType


def load(name: str) -> ModuleType:
    """This package's module `name` ("backend", "attention" or "dequant"), imported on first use."""
    return importlib.import_module(f"{__name__}.{name}")


def installed() -> bool:
    """Whether triton can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
