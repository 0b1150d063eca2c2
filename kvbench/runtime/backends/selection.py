"""Which attention backend an engine runs (runtime.attention_backend).

    backend = select_backend("auto", model.device, cache)    # a CpuBackend on CPU, a TritonBackend on CUDA, ...
"""
from __future__ import annotations

import os

import torch

from kvbench.runtime.backends import triton as triton_backend
from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu.backend import CPU
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.run.spec import ATTENTION_BACKENDS



def select_backend(name: str, device: torch.device, cache) -> AttentionBackend:
    """auto: Triton on CUDA (keys cached after RoPE; a codec cache's packed blocks are read in place where the codec
    lists "triton_attention", else dequantized), the C kernels on CPU (when they build), the torch reference
    otherwise. An explicit choice that cannot run raises ValueError."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    on_cuda = device.type == "cuda"
    # on a CPU the Triton kernels run only under the interpreter (TRITON_INTERPRET=1: tests)
    triton_device = on_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    usable_triton = triton_device and not cache.store_pre_rope and triton_backend.installed()
    if name == "triton" and not usable_triton:
        raise ValueError("attention_backend=triton needs a CUDA device (or TRITON_INTERPRET=1), triton installed "
                         "and post-RoPE keys")
    if name == "cpu" and on_cuda:
        raise ValueError("attention_backend=cpu needs the model on the CPU")
    if name == "triton" or (name == "auto" and usable_triton and on_cuda):
        return triton_backend.load("backend").TritonBackend()
    if name == "cpu" or (name == "auto" and not on_cuda):
        if cpu_kernels.load_kernel() is not None:
            return CPU
        if name == "cpu":
            raise ValueError(f"attention_backend=cpu: the C kernel could not be built ({cpu_kernels.kernel_error()})")
    return TORCH

