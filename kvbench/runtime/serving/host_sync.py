"""Counting host syncs: the calls that read a tensor's value on the host (on a GPU, each waits for the device).

    with HostSyncCounter() as syncs:
        engine.decode_batch(slots, tokens, positions)
    syncs.count, syncs.calls          # 1, ["tolist"]: the sampled tokens

A `TorchFunctionMode` that sees every torch call made under it, on any device, so the same count holds on a CPU
(where nothing waits) as on a GPU (where each is a `cudaStreamSynchronize`, what `torch.cuda.set_sync_debug_mode`
reports there). Counted: `item`, `tolist`, `numpy`, `cpu`, `to(<cpu device>)` from a device, `__bool__` / `__int__` /
`__float__` / `__index__` (Python control flow on a tensor), and the ops whose output size depends on values:
`nonzero`, `unique`, `masked_select`, `repeat_interleave` without `output_size`, and indexing with a boolean mask.
A tensor built from host values (`torch.tensor(list)`) is a host-to-device copy that does not wait: not counted.
Nor are the reads the Triton interpreter makes (TRITON_INTERPRET=1 runs a kernel on the host, reading its
arguments there; on a GPU the same launch reads nothing on the host).
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique",
          "unique_consecutive", "masked_select", "argwhere"}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


_INTERPRETER = ("triton/runtime/interpreter.py", "triton/language/")


def _in_triton_interpreter(depth: int = 16) -> bool:
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if any(part in frame.f_code.co_filename for part in _INTERPRETER):
            return True
        frame = frame.f_back
    return False


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _is_host_read(name: str, args: tuple, kwargs: dict) -> bool:
    if name in _READS:
        return True
    if name == "to":  # to the host from a device (on a CPU-only machine: never)
        dev = kwargs.get("device")
        if dev is None:
            dev = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
        src = args[0].device if args and isinstance(args[0], torch.Tensor) else None
        return dev is not None and torch.device(dev).type == "cpu" and src is not None and src.type != "cpu"
    if name == "repeat_interleave":
        return "output_size" not in kwargs and len(args) > 1 and isinstance(args[1], torch.Tensor)
    if name in _INDEXING:
        return len(args) > 1 and _has_bool_index(args[1])
    return False


class HostSyncCounter(TorchFunctionMode):
    """Counts host syncs (module docstring) made by torch calls under it; `calls` names them in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._depth = 0

    @property
    def count(self) -> int:
        return len(self.calls)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self._depth == 0 and _is_host_read(name, args, kwargs) and not _in_triton_interpreter():
            self.calls.append(name)
        self._depth += 1  # a counted call's own inner torch calls are not counted again
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1
