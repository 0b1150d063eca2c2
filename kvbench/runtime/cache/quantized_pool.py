"""The block pool of a storage codec's cache: two BlockPools in one id space (full-precision and packed blocks), with
the bytes both hold counted against one limit (kvbench.runtime.cache.quantized_cache).

With page retrieval, a block of a layer that retrieves pages also carries a key summary (`summary_bytes`): each
BlockPool tags such blocks as they are allocated and counts them, so the bytes in use (and their peak, and the
limit) count a summary for those blocks only (block_pool.py)."""
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
        self.fp_block_bytes, self.packed_block_bytes = fp_block_bytes, packed_block_bytes  # K/V only
        self.summary_bytes = 0  # a tagged block's key summary (count_summaries)
        self.fp.set_block_bytes(fp_block_bytes)
        self.packed.set_block_bytes(packed_block_bytes)
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

    def count_summaries(self, summary_bytes: int) -> None:
        """Blocks allocated from now on may carry a key summary of `summary_bytes` (tagged; untagged callers: every
        block, the bound); counted in the bytes in use, their peak and the limit."""
        self.summary_bytes = int(summary_bytes)
        self.fp.set_block_bytes(self.fp_block_bytes, self.fp_block_bytes + self.summary_bytes, default_tag=1)
        self.packed.set_block_bytes(self.packed_block_bytes, self.packed_block_bytes + self.summary_bytes,
                                    default_tag=1)
        self.peak_bytes = self.bytes_in_use()

    @property
    def fp_block_bound(self) -> int:
        """The most bytes one full-precision block takes (with a key summary, where blocks may carry one)."""
        return self.fp_block_bytes + self.summary_bytes

    @property
    def packed_block_bound(self) -> int:
        """The most bytes one packed block takes (with a key summary, where blocks may carry one)."""
        return self.packed_block_bytes + self.summary_bytes

    def free_fp_blocks(self) -> int:
        """Full-precision blocks that can surely be allocated now (ids free and bytes left under max_bytes, each at
        its largest size)."""
        return min(self.fp.num_free, max(0, self.max_bytes - self.bytes_in_use()) // self.fp_block_bound)

    def _room(self, n: int, tags, block_bytes: int, default_tag: int) -> bool:
        tagged = default_tag * n if tags is None else sum(1 for t in tags if t)
        return self.bytes_in_use() + n * block_bytes + tagged * self.summary_bytes <= self.max_bytes

    def allocate(self, n: int, tags=None) -> list[int]:
        """n full-precision blocks (`tags`: BlockPool.allocate's)."""
        if n > self.fp.num_free or not self._room(n, tags, self.fp_block_bytes, self.fp.default_tag):
            raise OutOfBlocksError(n, self.free_fp_blocks(), self.max_bytes // self.fp_block_bound)
        ids = self.fp.allocate(n, tags)
        self._track()
        return ids

    def allocate_packed(self, n: int, tags=None) -> list[int]:
        """n packed blocks (ids in the shared id space; `tags`: BlockPool.allocate's)."""
        if not self._room(n, tags, self.packed_block_bytes, self.packed.default_tag):
            raise OutOfBlocksError(n, max(0, self.max_bytes - self.bytes_in_use()) // self.packed_block_bound,
                                   self.max_bytes // self.packed_block_bound)
        ids = self.packed.allocate(n, tags)
        self._track()
        return [self.offset + i for i in ids]

    def tags_of(self, ids) -> list[int]:
        """BlockPool.tags_of, routed by id."""
        off = self.offset
        return [self.fp.tags_of((b,))[0] if int(b) < off else self.packed.tags_of((int(b) - off,))[0] for b in ids]

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
        self._track()  # a cached free block taken back

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
        """Bytes of the blocks in use of both pools, each at its kind's size (K/V, and its summary if tagged)."""
        return self.fp.bytes_in_use() + self.packed.bytes_in_use()

    def shared_bytes(self) -> int:
        """Bytes of the extra references forks hold to shared blocks (each holder beyond the first)."""
        return self.fp.shared_bytes() + self.packed.shared_bytes()

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
