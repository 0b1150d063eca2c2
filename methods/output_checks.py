"""What a method hands the runtime, checked where the runtime receives it: a scorer's scores and a keep set.

    check_scores(method, obs, scores)   score(obs) must be a tensor [H_kv, T] of real numbers on the cache's device,
                                        without NaN
    check_keep(method, obs, keep)       a keep set must be an integer tensor [H_kv, n <= T] on the cache's device,
                                        slots in [-1, T)

A wrong output (a user's scorer returning [H, T-1], a list, NaN, a tensor on the meta device) would otherwise run
with status ok on garbage, or fail deep in the runtime with a line that does not name the method. The error names the
method, the layer and what was wrong. Shapes, dtypes and devices are read from the tensors' metadata (free). The
values (NaN, slots out of range) need a read on the host: they are checked at prefill, where every scorer runs once per
layer, and not in decode steps, whose one-sync-per-step budget (tests/runtime/test_host_syncs.py) a read would break. +inf and -inf are scores (always / never keep), not errors.
"""
from __future__ import annotations

from typing import Any

import torch


class MethodOutputError(RuntimeError):
    """A method returned something the runtime cannot use (wrong shape, type, device, NaN): the run fails, naming
    the method, the layer and what was wrong."""


def _where(method: Any, obs: Any) -> str:
    return f"method {method.name!r} (layer {obs.layer}, {obs.phase})"


def _shape(x: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in x.shape) + "]"


def table_width(obs: Any) -> int:
    """T: the longest table of obs's layer (the width of obs.keys), from the step's host copy when there is one."""
    gathered = getattr(obs, "_kv", None)
    if gathered is not None:
        return int(gathered[0].shape[1])
    if getattr(obs, "context", None) is not None and getattr(obs.context, "plan", None) is not None:
        return max(obs.table_lengths(), default=0)
    return int(obs.keys.shape[1])


def values_checked(obs: Any) -> bool:
    """Whether the values (NaN, slot ranges) are checked in this step: at prefill (a decode step keeps its single
    host sync)."""
    return obs.phase == "prefill"


def check_scores(method: Any, obs: Any, scores: Any, what: str = "score()") -> torch.Tensor:
    """scores, if they are [H_kv, T] real numbers on the cache's device without NaN; MethodOutputError otherwise."""
    where = _where(method, obs)
    if not isinstance(scores, torch.Tensor):
        raise MethodOutputError(f"{where}: {what} returned a {type(scores).__name__}; expected a torch.Tensor "
                                f"[H_kv, T] of scores (higher = keep)")
    H, T = int(obs.lengths.shape[0]), table_width(obs)
    if tuple(scores.shape) != (H, T):
        raise MethodOutputError(f"{where}: {what} returned shape {_shape(scores)}; expected [{H}, {T}] "
                                f"([H_kv, T]: one score per cached token of each kv-head)")
    if scores.dtype == torch.bool or scores.is_complex():
        raise MethodOutputError(f"{where}: {what} returned dtype {scores.dtype}; expected real numbers (a float "
                                f"or integer dtype)")
    device = obs.lengths.device
    if scores.device != device:
        raise MethodOutputError(f"{where}: {what} returned a tensor on {scores.device}; expected the cache's "
                                f"device {device}")
    if values_checked(obs) and scores.is_floating_point() and bool(torch.isnan(scores).any()):
        n = int(torch.isnan(scores).sum())
        raise MethodOutputError(f"{where}: {what} returned {n} NaN of {scores.numel()} scores; expected numbers "
                                f"(+inf / -inf rank first / last)")
    return scores


def check_keep(method: Any, obs: Any, keep: Any) -> torch.Tensor:
    """keep, if it is an integer tensor [H_kv, n <= T] on the cache's device with slots in [-1, T); else
    MethodOutputError."""
    where = _where(method, obs)
    if not isinstance(keep, torch.Tensor):
        raise MethodOutputError(f"{where}: its keep set is a {type(keep).__name__}; expected a torch.Tensor [H_kv, n] "
                                f"of slot indices (-1 pads)")
    H, T = int(obs.lengths.shape[0]), table_width(obs)
    if keep.dim() != 2 or int(keep.shape[0]) != H or int(keep.shape[1]) > T:
        raise MethodOutputError(f"{where}: its keep set has shape {_shape(keep)}; expected [{H}, n] with n <= {T}")
    if keep.dtype not in (torch.int64, torch.int32):
        raise MethodOutputError(f"{where}: its keep set has dtype {keep.dtype}; expected torch.int64 slot indices")
    device = obs.lengths.device
    if keep.device != device:
        raise MethodOutputError(f"{where}: its keep set is on {keep.device}; expected the cache's device {device}")
    if values_checked(obs) and keep.numel() and bool(((keep < -1) | (keep >= T)).any()):
        raise MethodOutputError(f"{where}: its keep set holds slots outside [-1, {T}) (min {int(keep.min())}, "
                                f"max {int(keep.max())})")
    return keep
