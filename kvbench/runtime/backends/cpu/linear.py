"""Projection weights in the layout the device multiplies fastest.

On CPU (fp32, bf16) the weight is reordered once into oneDNN's blocked layout and multiplied with
oneDNN's linear (the path torch.compile's CPU backend emits), faster than ``x @ W_t`` through MKL, which is slow
at small M. Elsewhere (CUDA, fp16 on CPUs without fp16 units, torch builds without oneDNN) the weight is stored
transposed and multiplied as ``x @ W_t``.

fp32 on CPU with kvbench's C kernels: inputs of at most `kernels.LINEAR_GEMV_MAX_ROWS` (4) rows, and the
projections of a pure decode step of up to `kernels.GEMV_MAX_ROWS` (16) sequences, go through a C GEMV over a
second, [out, in] copy of the weight (csrc/decode_ops.c; a register tile of weight rows by input rows, 4 x 2 on AVX2 and 8 x 3 on AVX-512),
faster than oneDNN there; the fused decode step reads the same copy. With more rows oneDNN's packed layout wins.
A prefill chunk of more than 4 tokens always takes oneDNN, alone or inside a ragged step, so both give the same
numbers (a 2-bit codec turns a last-bit difference into a flipped code). Measured figures: docs/benchmark-results.md.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch
import torch.nn.functional as F

from kvbench.runtime import huge_pages
from kvbench.runtime.backends.cpu import kernels

ONEDNN_BATCH_HINT = 16  # rows the packed layout is tuned for; any number of rows works


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_BATCH_HINT)
    except (RuntimeError, AttributeError):  # CPU lacks the dtype's instructions, or an older torch
        return None


def _use_gemv(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    return kernels.available()


class Linear:
    """y = x @ W^T + b for x [..., in] -> [..., out]; W given as [out, in] (transformers' layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.dtype, self.device = weight.dtype, weight.device
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)
        self.bias = bias
        self._packed = _onednn_pack(weight)
        self._onednn_linear = torch.ops.mkldnn._linear_pointwise.default if self._packed is not None else None
        # fallback layout [in, out]: x @ W_t streams rows of W_t, faster than F.linear in a CPU GEMV
        # (figures: docs/benchmark-results.md)
        self._w_t = weight.t().contiguous() if self._packed is None else None
        self._dense: torch.Tensor | None = None  # kept only inside `keep_dense_weights` (autograd passes)
        # fp32 on CPU with the C kernels: decode-sized inputs (<= LINEAR_GEMV_MAX_ROWS rows) stream this [out, in] copy
        # through kernels.gemv; the packed copy serves prefill and larger batches. Costs one more copy of the
        # weights in memory for faster decode steps (see the module docstring).
        # (on huge pages: kvbench.runtime.huge_pages)
        self._plain = huge_pages.copy_of(weight) if self._packed is not None and _use_gemv(weight) else None

    @property
    def backend(self) -> str:
        return "onednn" if self._packed is not None else "matmul"

    def dense_weight(self) -> torch.Tensor:
        """The weight as [out, in], read-only (the plain copy when kept, else a fresh copy of oneDNN's layout)."""
        if self._plain is not None:
            return self._plain
        return self._packed.to_dense() if self._packed is not None else self._w_t.t()

    def __call__(self, x: torch.Tensor, gemv_rows: int | None = None) -> torch.Tensor:
        """y for x [..., in]; inputs of at most `gemv_rows` rows (default `kernels.LINEAR_GEMV_MAX_ROWS`; the model
        passes `kernels.GEMV_MAX_ROWS` for a pure decode step) take the C GEMV where it applies."""
        if self._packed is not None:
            if x.requires_grad and torch.is_grad_enabled():  # oneDNN's op has no backward (KVQuant's Fisher pass)
                w = self._dense if self._dense is not None else self.dense_weight()
                return F.linear(x, w, self.bias)
            rows = kernels.LINEAR_GEMV_MAX_ROWS if gemv_rows is None else min(gemv_rows, kernels.GEMV_MAX_ROWS)
            if self._plain is not None and x.numel() <= rows * self.in_features:
                return kernels.gemv(x, self._plain, self.bias)
            return self._onednn_linear(x, self._packed, self.bias, "none", [None], "")
        y = x @ self._w_t
        return y + self.bias if self.bias is not None else y


@contextmanager
def keep_dense_weights(linears: Iterable[Linear]):
    """Within the block, autograd passes through these Linears reuse one dense copy of each weight instead of
    reordering oneDNN's layout back at every call (KVQuant calibration runs many forward+backward passes)."""
    linears = list(linears)
    for lin in linears:
        if lin._packed is not None:
            lin._dense = lin.dense_weight()
    try:
        yield
    finally:
        for lin in linears:
            lin._dense = None
