"""Host tensors on transparent huge pages, for the memory a CPU decode step streams (weights, K/V pools).

Why: a batch-1 decode step reads every weight and every cached K/V row once, hundreds of MB, from DRAM. On 4 KiB
pages that is a TLB miss every 4 KiB (the paged K/V blocks sit anywhere in the pool, so the walk is not even
sequential); on 2 MiB pages one in 512, and a weight or K/V stream reads measurably faster (bench/profile_decode.py
shows the effect on whole decode steps; the figures are in docs/benchmark-results.md).

`empty(shape, dtype, device)` returns an uninitialised tensor whose bytes start on a 2 MiB boundary of a fresh
anonymous mapping (its own mmap, never touched before: the allocator may hand back memory already faulted in on 4
KiB pages, which the advice would not change) advised MADV_HUGEPAGE, so the kernel backs it with huge pages as it is
first touched (pages are still touched only when written: a pool's untouched blocks cost nothing). The mapping is
unmapped when the last tensor on it is freed. Off Linux, off the CPU, for tensors under 2 MiB, or when the kernel
refuses the advice (THP `never`), it is a plain torch.empty (or ordinary pages). Set KVBENCH_HUGE_PAGES=0 to turn it
off.
"""
from __future__ import annotations

import mmap
import os
import sys
import warnings

import torch

HUGE_PAGE = 2 << 20  # bytes


def enabled(device: torch.device | str = "cpu") -> bool:
    """Whether `empty` maps huge-page memory for tensors on `device`."""
    return (torch.device(device).type == "cpu" and sys.platform.startswith("linux")
            and os.environ.get("KVBENCH_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE"))


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu"
          ) -> torch.Tensor:
    """torch.empty(shape, dtype, device), on 2 MiB-aligned memory of a fresh mapping advised MADV_HUGEPAGE where that
    applies (see the module docstring)."""
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not enabled(device):
        return torch.empty(shape, dtype=dtype, device=device)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, private, untouched
    with warnings.catch_warnings():  # a writable buffer: torch's "non-writable" warning does not apply
        warnings.simplefilter("ignore")
        raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    except OSError:  # THP off: ordinary pages, same bytes
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t on huge pages (see `empty`)."""
    out = empty(t.shape, t.dtype, t.device)
    out.copy_(t)
    return out
