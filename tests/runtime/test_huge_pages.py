"""kvbench.runtime.huge_pages: tensors for the memory a CPU decode step streams, on 2 MiB transparent huge pages."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvbench.runtime import huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def test_large_tensors_start_on_a_huge_page_and_hold_their_values(monkeypatch):
    monkeypatch.delenv("KVBENCH_HUGE_PAGES", raising=False)
    t = huge_pages.empty((3, 1000, 1000), torch.float32)
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    if huge_pages.enabled():
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    src = torch.randn(3, 1000, 1000)
    t.copy_(src)
    assert torch.equal(t, src)
    c = huge_pages.copy_of(src[:, :500])  # a non-contiguous source
    assert c.is_contiguous() and torch.equal(c, src[:, :500])


def test_small_tensors_and_the_switch_take_plain_torch_empty(monkeypatch):
    small = huge_pages.empty((16, 16), torch.float16)
    assert small.shape == (16, 16) and small.dtype == torch.float16
    monkeypatch.setenv("KVBENCH_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    off = huge_pages.empty((4 << 20,), torch.uint8)
    assert off.numel() == 4 << 20 and off.untyped_storage().nbytes() == 4 << 20  # no padding: a plain allocation


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(), reason="transparent huge pages off on this machine")
def test_the_kernel_backs_touched_memory_with_huge_pages(monkeypatch):
    monkeypatch.delenv("KVBENCH_HUGE_PAGES", raising=False)
    churn = torch.ones(24 << 20)  # 96 MiB touched, then freed: the allocator may hand such memory back, faulted
    del churn  # in on small pages (a long test worker's heap failed this way); huge_pages maps its own
    t = huge_pages.empty((8 << 20,), torch.float32)  # 32 MiB
    t.fill_(1.0)  # first touch
    kib = _anon_huge_kib(t.data_ptr())
    assert kib is not None and kib >= 2048, f"AnonHugePages {kib} KiB for a 32 MiB advised region"
