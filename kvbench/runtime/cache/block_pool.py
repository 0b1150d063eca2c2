"""Block pool: a fixed set of KV blocks handed out from a free list, with reference counts.

The pool only does bookkeeping (which block ids are free, who holds them); the bytes live in the
storage tensors of `kvbench.runtime.cache.kv_cache`. Allocation and free are O(1) per block.

The free list is a stack: the blocks freed last are handed out first, so a new sequence reuses memory
that is already mapped and warm instead of touching fresh pages of the (mostly virtual) pool; each
allocation comes out in ascending id order, so a table's blocks tend to sit next to each other.

With a prefix cache (`retain_rank` set), a freed block that the cache still names keeps its contents as a cached
free block (vLLM's evictable cached blocks): it counts as free, but an allocation takes the plain free blocks
first and evicts cached ones only when those run out, least recently freed first and, among blocks freed together,
the deepest in their prompt first (so a cached prefix loses its tail before its head). Evicting tells
`evict_listeners`, which forget what the block held; a request that finds the block cached takes it back (`share`).

Bytes: blocks come in two kinds of one size each (`set_block_bytes`): plain (K/V only) and tagged (K/V and a key
summary, which a retrieval method keeps for the blocks of the layers that retrieve pages: block_summaries.py). Each
block is tagged as it is allocated (`allocate(n, tags)`; untagged callers get `default_tag`), keeps its tag while it
is held or cached free, and the pool counts the tagged blocks in use and shared, so the bytes held
(`bytes_in_use`), their peak (`peak_bytes`, updated wherever blocks are taken) and the bytes forks share are
measured from the blocks in use of each kind, not from a formula.
"""
from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable

import torch


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
        # cached free blocks (refcount 0, contents kept for a prefix cache), least recently freed first
        self._evictable: dict[int, None] = {}
        self._cached_flags = bytearray(num_blocks)  # 1 for the blocks in _evictable (counted in bulk by a view)
        self.retain_rank: Callable[[int], int | None] | None = None  # a freed block's depth in a cached prompt
        self.evict_listeners: list = []  # f(ids) called with the cached free blocks an allocation takes back
        # kinds of block (see the module docstring): tag 1 = the block also carries a key summary
        self._tags = bytearray(num_blocks)
        self.default_tag = 0  # the tag of a block allocated without tags
        self.tagged_in_use = 0  # tagged blocks in use (refcount > 0)
        self.tagged_shared_refs = 0  # shared_refs of tagged blocks
        self.block_bytes = (0, 0)  # (bytes of a plain block, of a tagged one): set_block_bytes
        self.peak_bytes = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free blocks and cached free ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free(self) -> int:
        return len(self._evictable)

    @property
    def in_use(self) -> int:
        return self.capacity - self.num_free

    def set_block_bytes(self, plain: int, tagged: int | None = None, default_tag: int = 0) -> None:
        """Bytes of a plain block and of a tagged one (the same by default); blocks allocated without tags from
        now on get `default_tag`. Set while the pool is empty (the peak restarts)."""
        if self.in_use:
            raise ValueError("set_block_bytes: the pool already holds blocks")
        self.block_bytes = (int(plain), int(plain if tagged is None else tagged))
        self.default_tag = 1 if default_tag else 0
        self.peak_bytes = 0

    def bytes_in_use(self) -> int:
        """Bytes of the blocks in use, each at its kind's size."""
        plain, tagged = self.block_bytes
        return (self.in_use - self.tagged_in_use) * plain + self.tagged_in_use * tagged

    def shared_bytes(self) -> int:
        """Bytes of the references beyond each shared block's first (what forks share, held once here)."""
        plain, tagged = self.block_bytes
        return (self.shared_refs - self.tagged_shared_refs) * plain + self.tagged_shared_refs * tagged

    def tags_of(self, ids: Iterable[int]) -> list[int]:
        """The tag of each block id (1: it carries a key summary); a freed block keeps its tag until reallocated."""
        tags = self._tags
        return [tags[int(b)] for b in ids]

    def is_cached_free(self, block_id: int) -> bool:
        return block_id in self._evictable

    def count_cached_free(self, ids) -> int:
        """How many of the block ids (an integer tensor, any shape) are cached free blocks."""
        flags = torch.frombuffer(self._cached_flags, dtype=torch.uint8)
        return int(flags[ids.flatten().long()].sum())

    def allocate(self, n: int, tags=None) -> list[int]:
        """Take `n` free blocks (refcount 1 each), plain free blocks first, then cached ones (evicted, least
        recently freed first); all or nothing. `tags`: n values, 1 for a block that carries a key summary (None:
        every block gets `default_tag`)."""
        if n > self.num_free:
            raise OutOfBlocksError(n, self.num_free, self.capacity)
        if tags is not None and len(tags) != n:
            raise ValueError(f"allocate: {len(tags)} tags for {n} blocks")
        free, ref = self._free, self._refcount
        if n > len(free):
            self._evict(n - len(free))
        ids = free[len(free) - n:][::-1]
        del free[len(free) - n:]
        kinds = self._tags
        if tags is None:
            t = self.default_tag
            for b in ids:
                ref[b] = 1
                kinds[b] = t
            self.tagged_in_use += t * n
        else:
            tagged = 0
            for b, t in zip(ids, tags):
                ref[b] = 1
                t = 1 if t else 0
                kinds[b] = t
                tagged += t
            self.tagged_in_use += tagged
        in_use = self.capacity - len(free)
        if in_use > self.peak_in_use:
            self.peak_in_use = in_use
        self._track_bytes()
        return ids

    def _track_bytes(self) -> None:
        now = self.bytes_in_use()
        if now > self.peak_bytes:
            self.peak_bytes = now

    def _take_cached(self, b: int) -> None:
        """Block b is no longer a cached free block (evicted, uncached or taken back)."""
        del self._evictable[b]
        self._cached_flags[b] = 0

    def _evict(self, n: int) -> None:
        """Move n cached free blocks (the least recently freed) to the plain free list; listeners forget them."""
        ids = list(islice(self._evictable, n))
        for b in ids:
            self._take_cached(b)
        self._free.extend(reversed(ids))
        for listener in self.evict_listeners:
            listener(ids)

    def uncache(self, ids: Iterable[int]) -> None:
        """Cached free blocks whose contents no one will look up again: plain free blocks now (taken first)."""
        for b in ids:
            if b in self._evictable:
                self._take_cached(b)
                self._free.append(b)

    def share(self, ids: Iterable[int]) -> None:
        """Add one reference to each block (a forked sequence now also holds it); a cached free block is taken
        back from the free list (a prefix-cache hit on a block no sequence held)."""
        ref, kinds = self._refcount, self._tags
        revived = False
        for b in ids:
            if ref[b] <= 0:
                if b not in self._evictable:
                    raise ValueError(f"cannot share free block {b}")
                self._take_cached(b)
                ref[b] = 1
                self.tagged_in_use += kinds[b]
                revived = True
                continue
            ref[b] += 1
            self.shared_refs += 1
            self.tagged_shared_refs += kinds[b]
        if revived:
            if self.in_use > self.peak_in_use:
                self.peak_in_use = self.in_use
            self._track_bytes()

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block; blocks whose count reaches zero return to the free list (and are
        returned), or, when a prefix cache names them (`retain_rank`), become cached free blocks."""
        ref, kinds = self._refcount, self._tags
        released = []
        cached: list[tuple[int, int]] = []  # (depth in its cached prompt, block) of freed blocks a cache names
        rank = self.retain_rank
        for b in ids:
            if ref[b] <= 0:
                raise ValueError(f"double free of block {b}")
            ref[b] -= 1
            if ref[b] == 0:
                self.tagged_in_use -= kinds[b]
                depth = rank(b) if rank is not None else None
                if depth is None:
                    released.append(b)
                else:
                    cached.append((depth, b))
            else:
                self.shared_refs -= 1
                self.tagged_shared_refs -= kinds[b]
        for _, b in sorted(cached, key=lambda t: -t[0]):  # evicted in this order: a prompt's tail first
            self._evictable[b] = None
            self._cached_flags[b] = 1
        self._free.extend(reversed(released))  # the first released comes out first again
        if released:
            for listener in self.release_listeners:
                listener(released)
        return released

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def reset_peak(self) -> None:
        self.peak_in_use = self.in_use
        self.peak_bytes = self.bytes_in_use()

    def check_consistency(self) -> None:
        """Assert the free list and the reference counts agree (used by tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "block on the free list twice"
        assert not free & set(self._evictable), "block both plain free and cached free"
        assert {b for b, f in enumerate(self._cached_flags) if f} == set(self._evictable), "cached flags out of step"
        free |= set(self._evictable)
        for b in range(self.reserved, self.num_blocks):
            if b in free:
                assert self._refcount[b] == 0, f"free block {b} has refcount {self._refcount[b]}"
            else:
                assert self._refcount[b] > 0, f"block {b} neither free nor referenced"
        assert self.shared_refs == sum(max(0, r - 1) for r in self._refcount), "shared_refs out of step"
        assert self.tagged_in_use == sum(t for t, r in zip(self._tags, self._refcount) if r > 0), \
            "tagged_in_use out of step"
        assert self.tagged_shared_refs == sum(t * max(0, r - 1) for t, r in zip(self._tags, self._refcount)), \
            "tagged_shared_refs out of step"
