"""The block pool of a storage codec's cache: two BlockPools in one id space (full-precision and packed blocks), with
the bytes both hold counted against one limit (kvbench.runtime.cache.quantized_cache)."""
from __future__ import annotations

from kvbench.runtime.cache.block_pool import BlockPool, OutOfBlocksError
from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCKS


class RoutedBlockPool:
    """Two BlockPools in one id space: ids < fp.num_blocks are full-precision blocks, the rest packed.

    Quacks like `BlockPool` for the cache code: `allocate` hands out full-precision blocks, `free` / `share` /
    `refcount` route by id. Tracks the peak of bytes in use (both pools together) at every allocation.
    """

    def __init__(self, num_fp: int, num_packed: int, fp_block_bytes: int, packed_block_bytes: int,
                 max_bytes: int | None = None):
        self.max_bytes = max_bytes if max_bytes is not None else (
            (num_fp - 1) * fp_block_bytes + num_packed * packed_block_bytes)
        self.fp = BlockPool(num_fp, reserved=SCRATCH_BLOCKS)
        self.packed = BlockPool(num_packed, reserved=0)
        self.offset = num_fp
        self.fp_block_bytes, self.packed_block_bytes = fp_block_bytes, packed_block_bytes
        self.peak_bytes = 0
        self.peak_in_use = 0
        self.release_listeners: list = []  # f(ids) with the ids (shared id space) each free() released

    # ---- BlockPool interface
    @property
    def num_blocks(self) -> int:
        return self.fp.num_blocks + self.packed.num_blocks

    @property
    def capacity(self) -> int:
        return self.fp.capacity + self.packed.capacity

    @property
    def num_free(self) -> int:
        return self.fp.num_free + self.packed.num_free

    @property
    def in_use(self) -> int:
        return self.fp.in_use + self.packed.in_use

    def free_fp_blocks(self) -> int:
        """Full-precision blocks that can be allocated now (ids free and bytes left under max_bytes)."""
        return min(self.fp.num_free, max(0, self.max_bytes - self.bytes_in_use()) // self.fp_block_bytes)

    def allocate(self, n: int) -> list[int]:
        """n full-precision blocks."""
        if n > self.free_fp_blocks():
            raise OutOfBlocksError(n, self.free_fp_blocks(), self.max_bytes // self.fp_block_bytes)
        ids = self.fp.allocate(n)
        self._track()
        return ids

    def allocate_packed(self, n: int) -> list[int]:
        """n packed blocks (ids in the shared id space)."""
        if self.bytes_in_use() + n * self.packed_block_bytes > self.max_bytes:
            raise OutOfBlocksError(n, max(0, self.max_bytes - self.bytes_in_use()) // self.packed_block_bytes,
                                   self.max_bytes // self.packed_block_bytes)
        ids = self.packed.allocate(n)
        self._track()
        return [self.offset + i for i in ids]

    def free(self, ids) -> list[int]:
        fp, packed = self._split(ids)
        released = self.fp.free(fp) + [self.offset + b for b in self.packed.free(packed)]
        if released:
            for listener in self.release_listeners:
                listener(released)
        return released

    def share(self, ids) -> None:
        fp, packed = self._split(ids)
        self.fp.share(fp)
        self.packed.share(packed)

    def refcount(self, block_id: int) -> int:
        b = int(block_id)
        return self.fp.refcount(b) if b < self.offset else self.packed.refcount(b - self.offset)

    def reset_peak(self) -> None:
        self.fp.reset_peak()
        self.packed.reset_peak()
        self.peak_bytes = self.bytes_in_use()
        self.peak_in_use = self.in_use

    def check_consistency(self) -> None:
        self.fp.check_consistency()
        self.packed.check_consistency()

    # ---- bytes
    def bytes_in_use(self) -> int:
        return self.fp.in_use * self.fp_block_bytes + self.packed.in_use * self.packed_block_bytes

    def shared_bytes(self) -> int:
        """Bytes of the extra references forks hold to shared blocks (each holder beyond the first)."""
        return self.fp.shared_refs * self.fp_block_bytes + self.packed.shared_refs * self.packed_block_bytes

    def _track(self) -> None:
        b = self.bytes_in_use()
        if b > self.peak_bytes:
            self.peak_bytes = b
            self.peak_in_use = self.in_use

    def _split(self, ids) -> tuple[list[int], list[int]]:
        fp, packed = [], []
        off = self.offset
        for b in ids:
            b = int(b)
            (fp if b < off else packed).append(b if b < off else b - off)
        return fp, packed
