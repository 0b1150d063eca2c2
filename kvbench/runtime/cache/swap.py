"""Swap space: preemption by moving a sequence's KV blocks to host memory and back, instead of recomputing them.

    swap = SwapSpace(cache, capacity_bytes=2**30)
    swap.swap_out(slot)      # its blocks' bytes copied to a host buffer, the blocks back to the pool at once
    ...
    swap.swap_in(slot)       # fresh blocks, the same bytes copied back: the tables read exactly what they read

The sequence keeps its slot while swapped out (its tables are empty, its lengths 0), so the method's per-sequence
state, keyed by slot, waits with it. Whatever the cache's layout (a codec's packed rows too), the bytes move as
they are (`PagedKVCache.block_payload` / `write_block_payload`): restoring is bit-identical. Counted: bytes and
blocks moved each way (`bytes_out`, `bytes_in`, `blocks_out`, `blocks_in`), the host bytes held now and at most.

On a GPU the link is PCIe and the host buffers are pinned; on a CPU-only machine the swap space is a separate host
buffer and "moving" is a memory copy, so the mechanism and its byte counts are real, and the time is a copy's.

The choice between swapping and recomputing (`runtime.preemption=auto`, the design notes' rule): swap a sequence
when moving its blocks out and back (2 x its held bytes over the link bandwidth, measured on the first copies)
costs less than prefilling its tokens again (at the prefill rate the run has measured so far); recompute short ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class _Swapped:
    ids: list[int]  # the distinct block ids it held (in payload order)
    tags: list[int]  # the pool's tag of each (1: it carries a key summary), given to the blocks swapped in
    tables: torch.Tensor  # [L, H, nb] int32 block ids as they were
    lengths: torch.Tensor  # [L, H]
    positions: torch.Tensor  # [L, H, nb*bs]
    payload: list[torch.Tensor]  # host copies, the cache's layout
    nbytes: int


class SwapSpace:
    """Host buffers for the blocks of swapped-out sequences of one cache, at most `capacity_bytes` at once."""

    def __init__(self, cache, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"swap capacity must be >= 0 bytes, got {capacity_bytes}")
        self.cache = cache
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = self.peak_bytes = 0
        self.bytes_out = self.bytes_in = self.blocks_out = self.blocks_in = 0
        self.swaps_out = self.swaps_in = 0
        self._moved_s = 0.0
        self._held: dict[int, _Swapped] = {}
        self._pin = cache.device.type == "cuda"

    # ------------------------------------------------------------------ queries
    def holds(self, slot: int) -> bool:
        return slot in self._held

    def bytes_of(self, slot: int) -> int:
        """Bytes swapping sequence `slot` out would move (its distinct blocks, in the pool's layout)."""
        return self.cache.block_payload_bytes(self._distinct_ids(slot))

    def can_swap_out(self, slot: int) -> bool:
        return self.used_bytes + self.bytes_of(slot) <= self.capacity_bytes

    def blocks_to_swap_in(self, slot: int) -> int:
        """Pool blocks swapping `slot` in takes."""
        return len(self._held[slot].ids)

    def bandwidth(self) -> Optional[float]:
        """Bytes per second the copies so far moved (None before any)."""
        moved = self.bytes_out + self.bytes_in
        return moved / self._moved_s if moved and self._moved_s > 0 else None

    def stats(self) -> dict:
        return {"swap_out_bytes": self.bytes_out, "swap_in_bytes": self.bytes_in, "swap_out_blocks": self.blocks_out,
                "swap_in_blocks": self.blocks_in, "swaps_out": self.swaps_out, "swaps_in": self.swaps_in,
                "swap_peak_bytes": self.peak_bytes, "swap_capacity_bytes": self.capacity_bytes}

    # ------------------------------------------------------------------ moving
    def _distinct_ids(self, slot: int) -> list[int]:
        c = self.cache
        nb = c._num_blocks(c.lengths[slot])  # [L, H]
        cols = torch.arange(c.tables.shape[-1], device=c.device)
        ids = c.tables[slot][cols < nb.unsqueeze(-1)]
        return torch.unique(ids).tolist()

    def swap_out(self, slot: int) -> int:
        """Copy sequence `slot`'s blocks to host memory and free them; its tables are emptied (lengths 0) and kept
        for swap_in. Returns the bytes moved."""
        c = self.cache
        if slot in self._held:
            raise ValueError(f"sequence {slot} is already swapped out")
        t0 = time.perf_counter()
        ids = self._distinct_ids(slot)
        nb = int(c._num_blocks(c.lengths[slot]).max()) if ids else 0
        payload = [t.to("cpu", copy=True).pin_memory() if self._pin else t.to("cpu", copy=True)
                   for t in c.block_payload(ids)]
        nbytes = sum(t.nbytes for t in payload)
        if self.used_bytes + nbytes > self.capacity_bytes:
            raise MemoryError(f"swap space full: {nbytes} bytes needed, {self.capacity_bytes - self.used_bytes} free")
        held = _Swapped(ids, c.pool.tags_of(ids), c.tables[slot, :, :, :nb].clone(), c.lengths[slot].clone(),
                        c.positions[slot, :, :, :nb * c.block_size].clone(), payload, nbytes)
        table_refs = c.tables[slot][torch.arange(c.tables.shape[-1], device=c.device)
                                    < c._num_blocks(c.lengths[slot]).unsqueeze(-1)].tolist()
        c.lengths[slot] = 0
        c.host_lengths[slot] = 0  # the host copy of the lengths follows every change (kv_cache.py)
        c.positions[slot] = -1
        c.pool.free(table_refs)
        self._held[slot] = held
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.bytes_out += nbytes
        self.blocks_out += len(ids)
        self.swaps_out += 1
        self._moved_s += time.perf_counter() - t0
        return nbytes

    def swap_in(self, slot: int) -> int:
        """Fresh blocks for sequence `slot`, its bytes copied back, its tables restored (OutOfBlocksError, nothing
        changed, when the pool lacks them). Returns the bytes moved."""
        c = self.cache
        held = self._held[slot]
        t0 = time.perf_counter()
        new = c.allocate_like(held.ids, held.tags)
        c.write_block_payload(new, [t.to(c.device, non_blocking=self._pin) for t in held.payload])
        nb = held.tables.shape[-1]
        if nb > c.max_blocks:
            c._grow_blocks(nb)
        lut = dict(zip(held.ids, new))
        remap = torch.tensor([lut.get(int(b), 0) for b in held.tables.flatten().tolist()], dtype=torch.int32,
                             device=c.device).view(held.tables.shape)
        refs = remap[torch.arange(nb, device=c.device) < c._num_blocks(held.lengths).unsqueeze(-1)].tolist()
        extra = len(refs) - len(new)  # a block held by several of its tables (after a fork) is shared again
        if extra:
            counts: dict[int, int] = {}
            for b in refs:
                counts[b] = counts.get(b, 0) + 1
            c.pool.share([b for b, n in counts.items() for _ in range(n - 1)])
        c.tables[slot, :, :, :nb] = remap
        c.lengths[slot] = held.lengths
        c.host_lengths[slot] = held.lengths.cpu().numpy()
        c.positions[slot, :, :, :held.positions.shape[-1]] = held.positions
        del self._held[slot]
        self.used_bytes -= held.nbytes
        self.bytes_in += held.nbytes
        self.blocks_in += len(new)
        self.swaps_in += 1
        self._moved_s += time.perf_counter() - t0
        return held.nbytes

    def discard(self, slot: int) -> None:
        """Forget a swapped-out sequence's bytes (its request ended while swapped out)."""
        held = self._held.pop(slot, None)
        if held is not None:
            self.used_bytes -= held.nbytes


def should_swap(mode: str, held_bytes: int, tokens: int, bandwidth: Optional[float],
                prefill_tokens_per_s: Optional[float]) -> bool:
    """Swap rather than recompute? "swap" always, "recompute" never; "auto" (the design notes' rule) when moving the
    blocks out and back in (2 x held_bytes over the link's bandwidth) costs less than prefilling `tokens` again at
    the measured prefill rate. Unknown rates: swap (no prefill measured yet means recomputing is the unknown)."""
    if mode == "swap":
        return True
    if mode == "recompute":
        return False
    if not bandwidth or not prefill_tokens_per_s:
        return True
    return 2.0 * held_bytes / bandwidth < tokens / prefill_tokens_per_s
