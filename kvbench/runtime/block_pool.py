"""Block pool: a fixed set of KV blocks handed out from a free list, with reference counts.

The pool only does bookkeeping (which block ids are free, who holds them); the bytes live in the
storage tensors of `kvbench.runtime.kv_cache`. Allocation and free are O(1) per block.

The free list is a stack: the blocks freed last are handed out first, so a new sequence reuses memory
that is already mapped and warm instead of touching fresh pages of the (mostly virtual) pool; each
allocation comes out in ascending id order, so a table's blocks tend to sit next to each other.
"""
from __future__ import annotations

from typing import Iterable


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free. Nothing is allocated then."""

    def __init__(self, requested: int, free: int, total: int):
        super().__init__(
            f"KV block pool exhausted: requested {requested} blocks, {free} free of {total}; "
            "raise runtime.kv_memory_bytes / runtime.num_blocks or lower the batch size / budget"
        )
        self.requested, self.free, self.total = requested, free, total


class BlockPool:
    """Free list + reference counts over `num_blocks` block ids.

    Block ids below `reserved` are never handed out (block 0 is a scratch block for writes that
    must land somewhere harmless).
    """

    def __init__(self, num_blocks: int, reserved: int = 1):
        if num_blocks <= reserved:
            raise ValueError(f"num_blocks must exceed {reserved}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.reserved = reserved
        self._free: list[int] = list(range(num_blocks - 1, reserved - 1, -1))  # top of the stack = lowest id
        self._refcount = [0] * num_blocks
        self.peak_in_use = 0
        # references beyond a block's first, over all blocks: what forked sequences share (each holder of a
        # shared block counts it once; the pool holds it once). Tables reference in_use + shared_refs blocks.
        self.shared_refs = 0
        self.release_listeners: list = []  # f(ids) called with the blocks each free() returned to the free list

    @property
    def capacity(self) -> int:
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each); all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), self.capacity)
        free, ref = self._free, self._refcount
        ids = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        for b in ids:
            ref[b] = 1
        in_use = self.capacity - len(free)
        if in_use > self.peak_in_use:
            self.peak_in_use = in_use
        return ids

    def share(self, ids: Iterable[int]) -> None:
        """Add one reference to each block (a forked sequence now also holds it)."""
        ref = self._refcount
        for b in ids:
            if ref[b] <= 0:
                raise ValueError(f"cannot share free block {b}")
            ref[b] += 1
            self.shared_refs += 1

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block; blocks whose count reaches zero return to the free list (and are
        returned)."""
        ref = self._refcount
        released = []
        for b in ids:
            if ref[b] <= 0:
                raise ValueError(f"double free of block {b}")
            ref[b] -= 1
            if ref[b] == 0:
                released.append(b)
            else:
                self.shared_refs -= 1
        self._free.extend(reversed(released))  # the first released comes out first again
        if released:
            for listener in self.release_listeners:
                listener(released)
        return released

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def reset_peak(self) -> None:
        self.peak_in_use = self.in_use

    def check_consistency(self) -> None:
        """Assert the free list and the reference counts agree (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        for b in range(self.reserved, self.num_blocks):
            if b in free:
                assert self._refcount[b] == 0, f"free block {b} has refcount {self._refcount[b]}"
            else:
                assert self._refcount[b] > 0, f"block {b} neither free nor referenced"
        assert self.shared_refs == sum(max(0, r - 1) for r in self._refcount), "shared_refs out of step"
