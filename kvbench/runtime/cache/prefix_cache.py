"""Prefix sharing in serving: vLLM's hashed prefix cache over the paged pool.

    pc = PrefixCache(cache)
    shared = pc.attach(slot, token_ids)        # a new sequence takes the cached blocks of its prompt's prefix
    ...                                        # (forward steps compute the rest)
    pc.register(slot, token_ids, n_computed)   # full blocks it computed become shareable

A logical block is block_size tokens of one sequence in every layer and kv-head table (L x H physical blocks).
Block i of a token list is keyed by (key of block i-1, its tokens) (vLLM's chained block hash; the tokens are kept
and compared, so a hash collision never shares wrong blocks). An entry maps a key to the L x H physical blocks that
hold exactly those tokens, at those positions, in some live sequence's tables. A sequence that attaches an entry
holds a reference on each of its blocks (the pool's reference counts); the entry itself holds none, so it lives as
long as some sequence holds its blocks: when a block's count reaches zero, or the block is modified in place
(token-level eviction compacting a table), every entry naming it is dropped. A codec's cache that packs a block
retargets the entry to the packed copy (`replace`).

Only blocks whose every table is untouched by the method (slot j of the block holds position j, in every layer and
head) are registered, so a method that compresses a prompt never offers its compressed blocks; a sequence holding
shared blocks that its method then compresses gets its own copies first (copy-on-write in PagedKVCache).

On a plain pool (`BlockPool`), an entry also outlives its last holder, as vLLM's cached free blocks do: blocks
freed while an entry names them stay cached in the pool (free, but handed out only after the plain free blocks,
least recently freed first, a prompt's tail before its head), so a request preempted by recompute, or a later
request with the same prompt, finds them; the entry is dropped when one of its blocks is handed out again (or
changed in place), and its other blocks become plain free blocks. A codec's pool keeps the first rule: an entry
lives while a sequence holds its blocks.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvbench.runtime.cache.block_pool import BlockPool
from kvbench.runtime.cache.kv_cache import PagedKVCache


class PrefixCache:
    """Hashed full blocks of computed token prefixes -> the physical blocks that hold them (see the module doc)."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self._entries: dict[tuple, torch.Tensor] = {}  # (parent key, tokens) -> ids [L, H] int32
        self._depth: dict[tuple, int] = {}  # key -> its block's index in the prompt
        self._by_block: dict[int, set[tuple]] = {}  # physical id -> keys of the entries naming it
        self.hits = 0  # blocks attached
        self.queries = 0  # full prompt blocks looked up
        pool = cache.pool
        pool.release_listeners.append(self._forget)
        self.retains_freed = isinstance(pool, BlockPool)  # a plain pool keeps freed cached blocks (module doc)
        if self.retains_freed:
            pool.retain_rank = self._rank
            pool.evict_listeners.append(self._forget)
        cache.block_listeners.append(self)

    # ------------------------------------------------------------------ keys
    def block_keys(self, token_ids: Sequence[int], n_blocks: int) -> list[tuple]:
        """Keys of the first n_blocks full blocks of token_ids (each chained to its parent's)."""
        bs = self.cache.block_size
        keys, parent = [], None
        for i in range(n_blocks):
            key = (hash(parent), tuple(token_ids[i * bs:(i + 1) * bs]))
            keys.append(key)
            parent = key
        return keys

    # ------------------------------------------------------------------ sharing
    def lookup(self, token_ids: Sequence[int]) -> list[torch.Tensor]:
        """The cached blocks [L, H] of the longest cached prefix of full blocks, leaving at least one token to
        compute (the last token's logits are needed)."""
        n = (len(token_ids) - 1) // self.cache.block_size
        found = []
        for key in self.block_keys(token_ids, n):
            ids = self._entries.get(key)
            if ids is None:
                break
            found.append(ids)
        return found

    def cached_free_blocks(self, blocks: list[torch.Tensor]) -> int:
        """How many of the physical blocks of `blocks` (a lookup's result) sit in the pool as cached free blocks:
        attaching them takes them from the free count."""
        if not blocks or not self.retains_freed or not self.cache.pool.num_cached_free:
            return 0
        return self.cache.pool.count_cached_free(torch.stack(blocks))

    def attach(self, slot: int, token_ids: Sequence[int]) -> int:
        """Give the new (empty) sequence `slot` the cached blocks of its longest cached prefix; returns the number
        of tokens it now holds (0: none cached)."""
        blocks = self.lookup(token_ids)
        self.queries += (len(token_ids) - 1) // self.cache.block_size
        if not blocks:
            return 0
        self.hits += len(blocks)
        self.cache.share_blocks(slot, torch.stack(blocks, dim=-1))  # [L, H, nb]
        return len(blocks) * self.cache.block_size

    def register(self, slot: int, token_ids: Sequence[int], n_computed: int, first_block: int = 0) -> int:
        """Offer the full blocks first_block.. of the first n_computed tokens of `slot` (all layers computed) for
        sharing; a block whose tables the method changed, and every block after it, is skipped. Returns the number
        of leading full blocks now covered (pass it back as first_block next time)."""
        c = self.cache
        bs = c.block_size
        n = n_computed // bs
        if n <= first_block:
            return first_block
        a = first_block
        lengths = c.lengths[slot]  # [L, H]
        if int(lengths.min()) < n * bs:  # a method dropped tokens somewhere: only the blocks before that can match
            n = min(n, int(lengths.min()) // bs)
            if n <= a:
                return a
        pos = c.positions[slot, :, :, a * bs:n * bs]  # [L, H, (n-a)*bs]
        want = torch.arange(a * bs, n * bs, dtype=pos.dtype, device=pos.device)
        ok = (pos == want).reshape(-1, n - a, bs).all(-1).all(0).tolist()  # [n-a]: block untouched everywhere
        keys = self.block_keys(token_ids, n)
        for i, good in enumerate(ok):
            b = a + i
            if not good:
                return b
            key = keys[b]
            if key in self._entries:
                continue  # another sequence's copy is already shared
            ids = c.tables[slot, :, :, b].clone()  # [L, H]
            self._entries[key] = ids
            self._depth[key] = b
            for bid in ids.flatten().tolist():
                self._by_block.setdefault(bid, set()).add(key)
        return n

    # ------------------------------------------------------------------ invalidation (called by the cache)
    def _rank(self, block_id: int) -> int | None:
        """The pool's question for a block being freed: its depth in a cached prompt, None when no entry names it."""
        keys = self._by_block.get(block_id)
        return max(self._depth[k] for k in keys) if keys else None

    def _forget(self, ids) -> None:
        """Blocks released, handed out again or about to change in place: drop every entry naming one of them;
        the entries' other blocks that sat cached in the pool become plain free blocks."""
        by_block = self._by_block
        if not by_block:
            return
        orphans = []
        for b in ids:
            keys = by_block.pop(int(b), None)
            for key in keys or ():
                entry = self._entries.pop(key, None)
                self._depth.pop(key, None)
                if entry is not None:
                    for other in entry.flatten().tolist():
                        s = by_block.get(other)
                        if s is not None:
                            s.discard(key)
                            if not s:
                                del by_block[other]
                                orphans.append(other)
        if orphans and self.retains_freed:
            self.cache.pool.uncache(orphans)

    def modified(self, ids) -> None:
        """Blocks about to be written in place (token-level eviction): their entries are no longer true."""
        self._forget(ids)

    def replace(self, old_ids: list[int], new_ids: list[int]) -> None:
        """A codec's cache packed blocks old_ids into new_ids (same tokens): entries follow the packed copies."""
        by_block = self._by_block
        if not by_block:
            return
        for old, new in zip(old_ids, new_ids):
            keys = by_block.pop(int(old), None)
            if not keys:
                continue
            for key in keys:
                entry = self._entries[key]
                entry[entry == int(old)] = int(new)
            by_block.setdefault(int(new), set()).update(keys)

    def __len__(self) -> int:
        return len(self._entries)
