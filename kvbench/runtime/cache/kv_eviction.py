"""The eviction operations: what a compression method may call on the cache, and how the cache carries them out.

A method (methods/*.py) sees the cache as a `MethodCacheView`: the geometry, the per-sequence lengths and tokens seen
(read only), the dense K/V of a layer (`gather`) and the named eviction operations below. It never writes the
cache's tensors, reads its pool or checks its class (vLLM's `remove_skipped_blocks` frees ids only); a storage codec's
cache carries out the same operations on its own layout. METHOD_SURFACE lists those names
(tests/runtime/test_method_cache_surface.py checks methods/ against it).

    keep_tokens(layer, slot, keep [H, n])              token level: keep these slots of each kv-head, compacted
    evict_blocks(layer, slot, head, blocks)            block level: drop whole full blocks of one table, no data moved
    evict_head_blocks(layer, slot, blocks[h])          evict_blocks for every kv-head of a layer at once
    evict_blocks_on_device(layer, slot, n, drop [H,k]) the same with the choice left on the device (no host sync);
                                                       the ids wait as pending frees until the engine takes them
    drop_slots(layer, slot, start, stop)               drop a range of slots of every kv-head (StreamingLLM's window)
    rewrite_tokens(layer, slot, keys=, values=, positions=)  overwrite what the held slots store (re-rotated keys,
                                                       merged values), nothing evicted (full-precision caches only)
    continue_positions_at(slot, n)                     the sequence's next tokens take positions n, n + 1, ... (after
                                                       re-rotating the kept keys to 0..n-1, as kvpress's pipeline)
    prune_key_channels(layer, slot, pruned [H, P])     key channels pruned per kv-head (ThinK): a cache built for it
                                                       (pruned_key_cache) stores the held blocks in fewer bytes; a
                                                       plain cache writes zeros in those channels

`KVEviction` is mixed into `PagedKVCache` (kvbench.runtime.cache.kv_cache): these operations and the pending frees.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvbench.runtime.cache.kv_geometry import blocks_for_tokens


class MethodCacheView(Protocol):
    """What a method may call on the cache (the hooks' `cache`, `ctx.cache`): nothing else."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    store_pre_rope: bool  # keys are cached before RoPE (rotated at read time)
    lengths: torch.Tensor  # [max_seqs, L, H] int64 tokens in each table (read only)
    tokens_seen: list[int]  # tokens appended to each sequence slot, before any eviction (read only)
    method_layers: tuple[int, ...]  # the layers a method acts on: the full-attention ones (sliding layers are the
    # runtime's ring, never compressed; their after_attention is never called)

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def keep_tokens(self, layer: int, slot: int, keep: torch.Tensor) -> None: ...

    def evict_blocks(self, layer: int, slot: int, head: int, block_indices: list[int]) -> None: ...

    def evict_head_blocks(self, layer: int, slot: int, blocks: list[list[int]]) -> None: ...

    def evict_blocks_on_device(self, layer: int, slot: int, n: int, drop: torch.Tensor) -> None: ...

    def drop_slots(self, layer: int, slot: int, start: int, stop: int) -> None: ...

    def rewrite_tokens(self, layer: int, slot: int, *, keys: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None: ...

    def continue_positions_at(self, slot: int, next_position: int) -> None: ...

    def prune_key_channels(self, layer: int, slot: int, pruned: torch.Tensor) -> None: ...


# The names of MethodCacheView's members: the whole of the cache a method may touch.
METHOD_SURFACE: frozenset[str] = frozenset(
    [name for name in MethodCacheView.__annotations__]
    + [name for name, v in vars(MethodCacheView).items() if callable(v) and not name.startswith("_")]
)


class KVEviction:
    """The eviction operations of a PagedKVCache and the block ids they leave pending (its tables, lengths,
    positions and pool are the cache's)."""

    # the window of each layer (None: full attention; empty: every layer full), set by the engine from the model's
    # config (kvbench.runtime.model.attention_types)
    layer_windows: tuple = ()

    @property
    def method_layers(self) -> tuple[int, ...]:
        """The layers a method acts on: every full-attention layer (all of them in a model without windows)."""
        w = self.layer_windows
        return tuple(i for i in range(self.num_layers) if not w or w[i] is None)

    # ------------------------------------------------------------------ the operations a method may call
    def keep_tokens(self, layer: int, slot: int, keep: torch.Tensor) -> None:
        """Token-level eviction: keep only slots `keep` [H, n] (sorted ascending per head; -1 pads a
        shorter head) of one sequence's layer, compact them to the front, free emptied blocks."""
        self._check_live(slot)
        bs, D = self.block_size, self.head_dim
        H = self.num_kv_heads
        old_len = self.lengths[slot, layer].clone()  # [H]
        new_len = (keep >= 0).sum(-1)  # [H]
        table = self.tables[slot, layer]  # [H, MB] view
        k_src = keep.clamp(min=0)
        n = keep.shape[-1]
        dst_slot = torch.arange(n, device=self.device).expand(H, n)
        valid = keep >= 0
        moved = valid & (keep != dst_slot)  # tokens already at their slot stay where they are
        if bool(moved.any()):
            written = torch.zeros(table.shape, dtype=torch.int64, device=self.device)  # [H, MB]
            written = written.scatter_add_(-1, (dst_slot // bs).to(torch.int64), moved.to(torch.int64)) > 0
            # written: the columns that receive a moved token
            if self._shared:  # copy-on-write: private copies of the shared blocks about to be written
                self._unshare_table(table, old_len, written)
            if self.block_listeners:
                self._modifying(table[written].tolist())
        src_rows = table.gather(-1, (k_src // bs).to(torch.int64)).to(torch.int64) * bs + k_src % bs  # [H, n]
        dst_rows = table.gather(-1, (dst_slot // bs).to(torch.int64)).to(torch.int64) * bs + dst_slot % bs
        if bool(moved.any()):
            src_rows, dst_rows = src_rows[moved], dst_rows[moved]
            kf = self.k_pool.view(-1, D)
            kf[dst_rows] = kf[src_rows]  # gathered first, so overlapping moves are safe
            if not self.latent:  # a latent cache's values moved with its keys
                vf = self.v_pool.view(-1, D)
                vf[dst_rows] = vf[src_rows]
        pos_row = self.positions[slot, layer]
        new_pos = pos_row.gather(-1, k_src.to(torch.int64))
        pos_row[:, :n] = torch.where(valid, new_pos, torch.full_like(new_pos, -1))
        self._release_tail_blocks(table, old_len, new_len)
        self.lengths[slot, layer] = new_len
        self.host_lengths[slot, layer] = new_len.cpu().numpy()
        if self.summarizes(layer) and bool(moved.any()):  # keys changed blocks: their min / max again
            self._summarize_table(layer, slot)

    def evict_blocks(self, layer: int, slot: int, head: int, block_indices: list[int]) -> None:
        """Block-level eviction: drop whole logical blocks of one (layer, kv-head) table without
        moving any K/V; only full blocks may be dropped (the table stays compact)."""
        blocks: list[list[int]] = [[] for _ in range(self.num_kv_heads)]
        blocks[head] = list(block_indices)
        self.evict_head_blocks(layer, slot, blocks)

    def evict_head_blocks(self, layer: int, slot: int, blocks: list[list[int]]) -> None:
        """evict_blocks for every kv-head of one sequence's layer at once: blocks[h] are head h's logical blocks to
        drop (may be empty). Two host copies (the layer's lengths and table rows) whatever the number of heads and
        blocks, where a device sync per head and block would cost more than the eviction on a GPU."""
        self._check_live(slot)
        if not any(blocks):
            return
        bs = self.block_size
        lengths = self.host_lengths[slot, layer].tolist()  # [H]
        if all(b == blocks[0] for b in blocks) and all(n == lengths[0] for n in lengths):
            self._evict_same_blocks_every_head(layer, slot, lengths[0], blocks[0])
            return
        width = max(blocks_for_tokens(n, bs) for n in lengths)
        rows = self.tables[slot, layer, :, :width].tolist()  # [H][width] physical block ids
        freed: list[int] = []
        for h, block_indices in enumerate(blocks):
            if not block_indices:
                continue
            n = lengths[h]
            drop, keep_cols = self._split_full_blocks(n, block_indices)
            freed += [rows[h][b] for b in drop]
            table = self.tables[slot, layer, h]
            table[: len(keep_cols)] = torch.tensor([rows[h][b] for b in keep_cols], dtype=table.dtype,
                                                   device=self.device)
            kc = torch.tensor(keep_cols, dtype=torch.int64, device=self.device)
            pos = self.positions[slot, layer, h]
            slot_idx = (kc[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)
            kept_pos = pos[slot_idx].clone()
            pos[: kept_pos.numel()] = kept_pos
            new_n = n - len(drop) * bs
            pos[new_n:] = -1
            self.lengths[slot, layer, h] = new_n
            self.host_lengths[slot, layer, h] = new_n
        self.pool.free(freed)

    def evict_blocks_on_device(self, layer: int, slot: int, n: int, drop: torch.Tensor) -> None:
        """evict_head_blocks with the choice left on the device: every kv-head of one sequence's layer is n tokens
        long and drops the logical blocks drop [H, k] (distinct per head, full blocks: never a partly filled
        last one). The tables and positions are compacted by tensor ops; the dropped block ids wait on the device
        until `take_pending_frees` (the engine reads them with the step's sampled tokens: one transfer), and
        only then go back to the pool: no host sync here."""
        self._check_live(slot)
        bs = self.block_size
        H, k = drop.shape
        nb = blocks_for_tokens(n, bs)
        if k >= nb or list(self.host_lengths[slot, layer]) != [n] * H:
            raise ValueError(f"evict_blocks_on_device: {k} blocks of tables of lengths "
                             f"{self.host_lengths[slot, layer].tolist()} (expected {n}, full blocks)")
        if k == 0:
            return
        cols = torch.arange(nb, device=self.device).expand(H, nb)
        dropped = torch.zeros(H, nb, dtype=torch.bool, device=self.device).scatter_(1, drop, True)
        keep = torch.where(dropped, nb, cols).sort(dim=1).values[:, : nb - k]  # [H, nb-k] kept columns, in order
        table = self.tables[slot, layer]  # [H, MB] view
        freed = table[:, :nb].gather(1, drop).reshape(-1)
        table[:, : nb - k] = table[:, :nb].gather(1, keep)
        pos = self.positions[slot, layer]  # [H, MB*bs] view
        src = (keep[:, :, None] * bs + torch.arange(bs, device=self.device)).reshape(H, -1)
        pos[:, : (nb - k) * bs] = pos.gather(1, src)
        pos[:, (nb - k) * bs:] = -1
        self.lengths[slot, layer] = n - k * bs
        self.host_lengths[slot, layer] = n - k * bs
        if self.defer_frees:
            self._pending_free.append(freed)
        else:
            self.pool.free(freed.tolist())

    def drop_slots(self, layer: int, slot: int, start: int, stop: int) -> None:
        """Drop slots start..stop-1 of every kv-head table of one sequence's layer (all heads as long as each
        other). Dropping exactly one block's worth frees one block: whole blocks when `start` is block-aligned,
        else the survivors of the next block move into the block where `start` falls (at most block_size - 1
        tokens move) and that next block is freed. Anything else, or a shared block, falls back to keep_tokens."""
        self._check_live(slot)
        bs = self.block_size
        lengths = self.host_lengths[slot, layer].tolist()  # [H]
        n = max(lengths)
        if not (0 <= start < stop <= n) or min(lengths) != n:
            raise ValueError(f"cannot drop slots {start}..{stop - 1} of tables of lengths {lengths}")
        a, r = divmod(start, bs)
        H = self.num_kv_heads
        if stop - start == bs and r == 0 and (a + 1) * bs <= n:
            self.evict_blocks_on_device(layer, slot, n, torch.full((H, 1), a, device=self.device))
            return
        table = self.tables[slot, layer]  # [H, MB]
        # never forked nor shared (self._shared): every refcount is 1, nothing to read from the device
        can_shift = (stop - start == bs and n >= (a + 2) * bs and self.plain_pools
                     and (not self._shared or not any(self.pool.refcount(b) > 1 for b in table[:, a].tolist())))
        if not can_shift:
            keep = torch.cat([torch.arange(start), torch.arange(stop, n)]).to(self.device)
            self.keep_tokens(layer, slot, keep.expand(self.num_kv_heads, -1))
            return
        dst = table[:, a].to(torch.int64)  # the block shared by the kept head and the dropped tail
        src = table[:, a + 1].to(torch.int64)  # its first r slots are the rest of the dropped range
        if self.block_listeners:
            self._modifying(dst.tolist())
        self.k_pool[dst, r:] = self.k_pool[src, r:]
        self.v_pool[dst, r:] = self.v_pool[src, r:]
        pos = self.positions[slot, layer]  # [H, MB*bs]
        pos[:, a * bs + r: (a + 1) * bs] = pos[:, (a + 1) * bs + r: (a + 2) * bs].clone()
        self.evict_blocks_on_device(layer, slot, n, torch.full((H, 1), a + 1, device=self.device))
        if self.summarizes(layer):  # block a received keys from block a + 1
            self._summarize_table(layer, slot)

    def _split_full_blocks(self, n: int, block_indices: list[int]) -> tuple[list[int], list[int]]:
        """(blocks to drop, sorted; blocks kept, in order) of an n-token table; only full blocks may be dropped."""
        bs = self.block_size
        nb = blocks_for_tokens(n, bs)
        drop = sorted(set(block_indices))
        for b in drop:
            if not (0 <= b < nb) or (b == nb - 1 and n % bs != 0):
                raise ValueError(f"block {b} of a {n}-token table is not a full block")
        dropped = set(drop)
        return drop, [b for b in range(nb) if b not in dropped]

    def _evict_same_blocks_every_head(self, layer: int, slot: int, n: int, block_indices: list[int]) -> None:
        """evict_head_blocks when every kv-head of the layer is n tokens long and drops the same logical blocks
        (heads="shared" eviction): one set of tensor ops over all heads instead of a set per head."""
        bs = self.block_size
        drop, keep = self._split_full_blocks(n, block_indices)
        keep_cols = torch.tensor(keep, dtype=torch.int64, device=self.device)
        table = self.tables[slot, layer]  # [H, MB] view
        freed = table[:, drop].reshape(-1).tolist()
        table[:, : keep_cols.numel()] = table[:, keep_cols]  # the right side is gathered first
        pos = self.positions[slot, layer]  # [H, MB * bs] view
        slot_idx = (keep_cols[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)
        pos[:, : slot_idx.numel()] = pos[:, slot_idx]
        new_n = n - len(drop) * bs
        pos[:, new_n:] = -1
        self.lengths[slot, layer] = new_n
        self.host_lengths[slot, layer] = new_n
        self.pool.free(freed)

    def _release_tail_blocks(self, table: torch.Tensor, old_len: torch.Tensor, new_len: torch.Tensor) -> None:
        old_nb, new_nb = self._num_blocks(old_len), self._num_blocks(new_len)
        freed: list[int] = []
        for h in range(table.shape[0]):
            a, b = int(new_nb[h]), int(old_nb[h])
            if b > a:
                freed.extend(table[h, a:b].tolist())
        self.pool.free(freed)

    def rewrite_tokens(self, layer: int, slot: int, *, keys: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Overwrite the held slots of one sequence's layer in place: keys / values [H, T, D] and positions [H, T]
        (T >= the longest table; slot t of head h is written where t < its length). Shared blocks are copied
        first (copy-on-write); nothing is evicted or freed."""
        self._check_live(slot)
        bs, D = self.block_size, self.head_dim
        lengths = self.lengths[slot, layer].clone()  # [H]
        T = int(lengths.max()) if lengths.numel() else 0
        if T == 0:
            return
        table = self.tables[slot, layer]  # [H, MB] view
        t = torch.arange(T, device=self.device)
        valid = t[None, :] < lengths[:, None]  # [H, T]
        if keys is not None or values is not None:
            if self._shared:
                self._unshare_table(table, lengths)
            if self.block_listeners:
                nb = self._num_blocks(lengths)
                self._modifying([int(table[h, c]) for h in range(table.shape[0]) for c in range(int(nb[h]))])
            rows = (table[:, t // bs].to(torch.int64) * bs + t % bs)[valid]  # [N] rows of the flat pools
            for src, pool in ((keys, self.k_pool), (values, self.v_pool)):
                if src is not None:
                    pool.view(-1, D)[rows] = src[:, :T].to(pool.dtype)[valid]
            if keys is not None and self.summarizes(layer):  # new keys: their blocks' min / max again
                self._summarize_table(layer, slot)
        if positions is not None:
            pos_row = self.positions[slot, layer]
            pos_row[:, :T] = torch.where(valid, positions[:, :T].to(pos_row.dtype), pos_row[:, :T])

    def prune_key_channels(self, layer: int, slot: int, pruned: torch.Tensor) -> None:
        """Prune key channels `pruned` [H, P] (each kv-head's own) of the tokens one sequence's layer holds. A
        full-precision cache keeps its layout and writes zeros in those channels (what attention then computes is the
        same as over a pruned layout, nothing is saved); kvbench.runtime.cache.pruned_key_cache stores them in fewer
        bytes."""
        self._check_live(slot)
        T = int(self.host_lengths[slot, layer].max()) if self.num_kv_heads else 0
        if T == 0:
            return
        keys, _, _ = self.gather(layer, slot)  # [H, T, D] (a copy)
        keys = keys.scatter(-1, pruned.to(keys.device, torch.int64)[:, None, :].expand(-1, T, -1), 0)
        self.rewrite_tokens(layer, slot, keys=keys)

    def _unshare_table(self, table: torch.Tensor, lengths: torch.Tensor, only: torch.Tensor | None = None) -> None:
        """Give a (layer) table private copies of its shared blocks (those where `only` [H, MB] is True, or all)
        before moving data in it."""
        nb = self._num_blocks(lengths)
        for h in range(table.shape[0]):
            for c in range(int(nb[h])):
                if only is not None and not bool(only[h, c]):
                    continue
                b = int(table[h, c])
                if self.pool.refcount(b) > 1:
                    (nid,) = self.pool.allocate(1, self.pool.tags_of((b,)))  # the same kind (summary or not)
                    self.k_pool[nid] = self.k_pool[b]
                    self.v_pool[nid] = self.v_pool[b]
                    if self.summaries is not None:
                        self.summaries.copy(torch.tensor([nid], device=self.device),
                                            torch.tensor([b], device=self.device))
                    table[h, c] = nid
                    self.pool.free([b])

    def _modifying(self, ids: list[int]) -> None:
        """Blocks about to be written in place (not appended to): listeners drop what they knew of them."""
        for listener in self.block_listeners:
            listener.modified(ids)

    # ------------------------------------------------------------------ sliding layers (the runtime's, not a method's)
    def slide_window(self, layer: int, slots: list[int], window: int) -> int:
        """Free the leading blocks of sliding layer `layer` that no later query can see: right after a step's
        attention of that layer, the newest slot of each table holds the step's last position p, so the next query
        (p + 1 or later) sees the last window - 1 slots at most; whole full blocks before those leave (no data
        moves: the table stays compact). A sliding layer is never compressed, so its slots hold consecutive
        positions. Bounds the layer's table to window - 1 + block_size tokens between steps. Returns blocks freed."""
        bs = self.block_size
        freed = 0
        for slot in slots:
            n = int(self.host_lengths[slot, layer].max())
            k = max(0, n - window + 1) // bs
            if k:
                self.evict_head_blocks(layer, slot, [list(range(k))] * self.num_kv_heads)
                freed += k * self.num_kv_heads
        return freed

    def held_lengths(self, slots: list[int]):
        """host_lengths[slots] [S, L, H], a scratch fork's rows (Engine.fork_sequence(scratch=True)) as the tokens of
        its private blocks (blocks_for_tokens of them is their count): the blocks it shares are its sequence's, counted
        in that row, so by-type held figures count each block once."""
        lengths = self.host_lengths[slots]  # a copy (fancy indexing)
        for i, slot in enumerate(slots):
            if slot in self.scratch_slots:
                lengths[i] = self._private_blocks(slot) * self.block_size
        return lengths

    def _private_blocks(self, slot: int):
        """[L, H] how many blocks of each table of `slot` no other table references (refcount 1)."""
        nb = blocks_for_tokens(self.host_lengths[slot], self.block_size)  # [L, H]
        tables = self.tables[slot, :, :, : max(1, int(nb.max()))].cpu().numpy()  # [L, H, nb]
        used = np.zeros(tables.shape, dtype=np.int64)
        for (layer, head), n in np.ndenumerate(nb):
            used[layer, head, :n] = [self.pool.refcount(int(b)) == 1 for b in tables[layer, head, :n]]
        return used.sum(-1)

    def _noted(self, plan):
        """`plan`, after noting the blocks each layer type's tables hold (a model with sliding layers): right after
        a step's allocation is when they hold the most within the step (every later change of the step frees:
        ring trims, evictions), so these maxima are the peaks by layer type (KVMeter.by_layer_type)."""
        w = self.layer_windows
        if not w or not any(x is not None for x in w):
            return plan
        live = sorted(self.live)
        lengths = self.held_lengths(live)  # [S, L, H]
        held = blocks_for_tokens(lengths, self.block_size)
        peaks = self.__dict__.setdefault("layer_type_peaks", {"full_bytes": 0, "sliding_bytes": 0,
                                                              "uncompressed_blocks": 0})
        full_layers = [i for i, x in enumerate(w) if x is None]
        sliding = [i for i, x in enumerate(w) if x is not None]
        for kind, layers in (("full", full_layers), ("sliding", sliding)):  # each layer's blocks at its size
            peaks[f"{kind}_bytes"] = max(peaks[f"{kind}_bytes"], self.held_bytes(lengths[:, layers], layers))
        # an uncompressed cache at this moment: the full layers at every token appended (this step's included),
        # the sliding layers as their rings hold them (never compressed); its peak is full_peak_kv_bytes. A scratch
        # fork (a method's own pass, Engine.fork_sequence(scratch=True)) is no sequence of the workload: left out
        counted = [i for i, s in enumerate(live) if s not in self.scratch_slots]
        seen = sum(int(blocks_for_tokens(self.tokens_seen[live[i]], self.block_size)) for i in counted)
        now = seen * len(full_layers) * self.num_kv_heads + int(held[counted][:, sliding].sum())
        peaks["uncompressed_blocks"] = max(peaks["uncompressed_blocks"], now)
        return plan

    # ------------------------------------------------------------------ pending frees (evict_blocks_on_device)
    def has_pending_frees(self) -> bool:
        """Whether evicted block ids wait on the device (see evict_blocks_on_device)."""
        return bool(self._pending_free)

    def pending_free_count(self) -> int:
        """How many evicted block references wait on the device (still counted in use by the pool)."""
        return sum(t.numel() for t in self._pending_free)

    def free_pending_now(self) -> None:
        """Return the waiting evicted blocks to the pool at once (one device read)."""
        if self._pending_free:
            self.free_pending(self.take_pending_frees().tolist())

    def take_pending_frees(self) -> torch.Tensor | None:
        """Block ids (int32, on the device) evicted by `evict_blocks_on_device` since the last call, or None; the
        caller copies them to the host and calls `free_pending(ids)`."""
        if not self._pending_free:
            return None
        ids = torch.cat(self._pending_free)
        self._pending_free = []
        return ids

    def free_pending(self, ids: list[int]) -> None:
        """Return blocks taken from take_pending_frees to the pool."""
        self.pool.free(ids)
