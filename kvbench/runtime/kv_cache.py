"""Paged KV cache: one block pool, block tables per sequence, per layer and per kv-head.

Layout (nano-vllm style, but one table per (sequence, layer, kv-head) so methods may keep
different tokens in different layers and heads):

    k_pool, v_pool: [num_blocks, block_size, head_dim]     the bytes (one block = one table's slots)
    tables:         [max_seqs, L, H, max_blocks] int32     physical block ids, in slot order
    lengths:        [max_seqs, L, H] int64                 valid slots per table
    host_lengths:   numpy int64 [max_seqs, L, H]           the same, kept on the host by every operation that
                                                           changes a length, so allocation reads no device value
    positions:      [max_seqs, L, H, max_blocks*bs] int32  original token position of each slot

Tables are kept compact: slots 0..len-1 are valid and every block but the last is full, so a
table of n tokens holds exactly ceil(n / block_size) blocks. Evicted blocks return to the pool at
once. Slot order is original-position order (appends go to the end; eviction keeps order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from kvbench.runtime.block_pool import BlockPool
from kvbench.runtime.kv_geometry import block_bytes, blocks_for_tokens, token_bytes

SCRATCH_BLOCK = 0  # reserved block id; never handed out


@dataclass
class AppendPlan:
    """Where the new tokens of one forward step go, for every layer and head."""

    slots: torch.Tensor  # [S] int64 sequence slots
    write_index: torch.Tensor  # [S, L, H, Q] int64 flat row in k_pool.view(-1, D)
    tables: torch.Tensor  # [S, L, H, nb] int32 snapshot after allocation (nb = most blocks any table holds)
    lengths: torch.Tensor  # [S, L, H] int64 after the append
    query_positions: torch.Tensor  # [S, Q] int64
    positions: torch.Tensor  # [S, L, H, nb*bs] int32 snapshot of key positions after the append
    slot_list: list[int]
    host_lengths: Optional[np.ndarray] = field(default=None, repr=False)  # [S, L, H] lengths, on the host
    max_position: Optional[int] = None  # the largest query position, when the caller knows it on the host

    def table_lengths(self, i: int, layer: int) -> list[int]:
        """lengths[i, layer] (one per kv-head) as Python ints, from the host copy the cache keeps (no device
        read). Exact for a layer until its own hook evicts: layers never change each other's tables."""
        if self.host_lengths is None:
            self.host_lengths = self.lengths.cpu().numpy()
        return self.host_lengths[i, layer].tolist()


class PagedKVCache:
    """Block tables over a preallocated K/V pool for a set of live sequences."""

    # Every block of every table is a [block_size, head_dim] row block of k_pool / v_pool in the cache dtype, written
    # by `write` and read by `attend` as here: kernels (the Triton attention, the fused CPU decode step) and
    # drop_slots may read, write and move those rows directly. A codec's cache, with its own block layout, sets False.
    plain_pools = True

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seqs: int = 64,
        initial_max_blocks: int = 64,
        store_pre_rope: bool = False,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.store_pre_rope = store_pre_rope
        self._make_storage(num_blocks)
        self.max_seqs = max_seqs
        self.max_blocks = initial_max_blocks
        L, H = num_layers, num_kv_heads
        self.tables = torch.zeros(max_seqs, L, H, self.max_blocks, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(max_seqs, L, H, dtype=torch.int64, device=self.device)
        self.host_lengths = np.zeros((max_seqs, L, H), dtype=np.int64)
        self.positions = torch.full(
            (max_seqs, L, H, self.max_blocks * block_size), -1, dtype=torch.int32, device=self.device
        )
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self.live: set[int] = set()
        self.tokens_seen = [0] * max_seqs  # tokens appended to each sequence (before any eviction)
        self._shared = False  # set once any fork happened: enables copy-on-write checks
        self.block_listeners: list = []  # objects with modified(ids) / replace(old, new) (the prefix cache)
        self._pending_free: list[torch.Tensor] = []  # evicted block ids not yet back in the pool (device)
        # evict_blocks_on_device leaves the ids on the device until take_pending_frees (an engine sets this: it
        # takes them with each step's sampled tokens); False: they go back to the pool at once (a host read)
        self.defer_frees = False

    def _make_storage(self, num_blocks: int) -> None:
        """The block pool and the bytes: allocated once; pages are touched only as blocks are written.
        (A codec's cache overrides this with its own layout.)"""
        self.pool = BlockPool(num_blocks, reserved=1)
        shape = (num_blocks, self.block_size, self.head_dim)
        self.k_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.k_pool[SCRATCH_BLOCK] = 0
        self.v_pool[SCRATCH_BLOCK] = 0

    # ------------------------------------------------------------------ sizes and bytes
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies in the pool (K and V)."""
        return block_bytes(self.block_size, self.head_dim, self.k_pool.dtype)

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes an uncompressed cache needs per token (all layers, kv-heads, K and V)."""
        return token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def kv_bytes_in_use(self) -> int:
        return self.pool.in_use * self.bytes_per_block

    def peak_kv_bytes(self) -> int:
        return self.pool.peak_in_use * self.bytes_per_block

    def fork_shared_bytes(self) -> int:
        """Bytes that forked sequences share now: the live tables reference kv_bytes_in_use() + this
        (a block shared by n tables counts n times there, once in the pool); counted by the pool's refcounts."""
        return self.pool.shared_refs * self.bytes_per_block

    def pool_bytes(self) -> int:
        """The most K/V bytes the pool can hold at once."""
        return self.pool.capacity * self.bytes_per_block

    def kv_bytes_per_token(self) -> float:
        """Pool bytes one cached token costs across all layers and kv-heads (codecs override)."""
        return self.bytes_per_block * self.num_layers * self.num_kv_heads / self.block_size

    def describe_storage(self) -> dict:
        """Settings of the storage, recorded in results."""
        return {"codec": "full", "kv_dtype": str(self.dtype).replace("torch.", "")}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        """Reserve a sequence slot with empty tables."""
        if not self._free_slots:
            self._grow_seqs()
        s = self._free_slots.pop()
        self.lengths[s] = 0
        self.host_lengths[s] = 0
        self.positions[s] = -1
        self.tokens_seen[s] = 0
        self.live.add(s)
        return s

    def free_sequence(self, slot: int) -> None:
        """Return every block of the sequence to the pool."""
        self._check_live(slot)
        self.free_pending_now()  # evicted blocks first (their table entries are gone)
        nb = self._num_blocks(self.lengths[slot])  # [L, H]
        ids = _table_entries(self.tables[slot], nb)
        self.pool.free(ids)
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0
        self.live.discard(slot)
        self._free_slots.append(slot)

    def fork(self, slot: int) -> int:
        """A new sequence sharing all blocks of `slot` (copy-on-write on the next append)."""
        self._check_live(slot)
        child = self.add_sequence()
        self.tables[child] = self.tables[slot]
        self.lengths[child] = self.lengths[slot]
        self.host_lengths[child] = self.host_lengths[slot]
        self.positions[child] = self.positions[slot]
        self.tokens_seen[child] = self.tokens_seen[slot]
        self.pool.share(_table_entries(self.tables[slot], self._num_blocks(self.lengths[slot])))
        self._shared = True
        return child

    def share_blocks(self, slot: int, blocks: torch.Tensor) -> None:
        """Give the empty sequence `slot` the full blocks `blocks` [L, H, nb] (another sequence's first nb blocks of
        every table, holding positions 0..nb*bs-1): one more reference each, copy-on-write before any in-place
        change (the prefix cache's attach)."""
        self._check_live(slot)
        if self.host_lengths[slot].max() != 0:
            raise ValueError(f"share_blocks: sequence {slot} is not empty")
        nb = blocks.shape[-1]
        n = nb * self.block_size
        if nb > self.max_blocks:
            self._grow_blocks(nb)
        self.pool.share(blocks.flatten().tolist())
        self.tables[slot, :, :, :nb] = blocks.to(device=self.device, dtype=torch.int32)
        self.lengths[slot] = n
        self.host_lengths[slot] = n
        self.positions[slot, :, :, :n] = torch.arange(n, dtype=torch.int32, device=self.device)
        self.tokens_seen[slot] = n
        self._shared = True

    def _modifying(self, ids: list[int]) -> None:
        """Blocks about to be written in place (not appended to): listeners drop what they knew of them."""
        for listener in self.block_listeners:
            listener.modified(ids)

    # ------------------------------------------------------------------ appending
    def prepare_append(self, slots: list[int], query_positions: torch.Tensor) -> AppendPlan:
        """Allocate room for Q new tokens in every layer/head table of each sequence.

        query_positions: [S, Q] original positions of the new tokens. Returns the flat pool rows
        each layer writes to. Raises OutOfBlocksError (nothing changed) if the pool is too small.
        """
        bs = self.block_size
        S, Q = query_positions.shape
        self.free_pending_now()  # evicted ids a caller did not take (it sampled nothing): back before allocating
        slot_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
        for s in slots:
            self._check_live(s)
        # block counts from the host copy of the lengths: allocating reads no device value
        old_len_h = self.host_lengths[slots]  # [S, L, H]
        new_len_h = old_len_h + Q
        old_nb_h = (old_len_h + bs - 1) // bs
        new_nb_h = (new_len_h + bs - 1) // bs
        max_nb = int(new_nb_h.max())
        if max_nb > self.max_blocks:
            self._grow_blocks(max_nb)
        old_len = self.lengths[slot_t]  # [S, L, H]
        new_len = old_len + Q
        # only the columns in use travel: copying whole rows would cost O(capacity) per decode step
        tables = self.tables[slot_t, :, :, :max_nb]  # [S, L, H, max_nb] copy
        need_h = (new_nb_h - old_nb_h).reshape(-1)
        total = int(need_h.sum())
        cow = self._copy_on_write_targets(tables, old_len) if self._shared else None
        n_cow = 0 if cow is None else int(cow[0].numel())
        ids = self.pool.allocate(total + n_cow)
        if n_cow:
            self._apply_copy_on_write(tables, cow, ids[total:])
        if total:
            ids_t = torch.tensor(ids[:total], dtype=torch.int32, device=self.device)
            # fresh blocks start zeroed: masked slots of a partly filled block must not hold NaN/inf
            self.k_pool.index_fill_(0, ids_t.to(torch.int64), 0)
            self.v_pool.index_fill_(0, ids_t.to(torch.int64), 0)
            rows_h = np.repeat(np.arange(need_h.size), need_h)  # the table row of each new block
            offs_h = np.arange(total) - (np.cumsum(need_h) - need_h)[rows_h]
            cols_h = old_nb_h.reshape(-1)[rows_h] + offs_h
            rows = torch.from_numpy(rows_h).to(self.device)
            cols = torch.from_numpy(cols_h).to(self.device)
            tables.view(-1, max_nb)[rows, cols] = ids_t
        self.tables[slot_t, :, :, :max_nb] = tables
        slot_idx = old_len.unsqueeze(-1) + torch.arange(Q, device=self.device)  # [S, L, H, Q]
        blocks = tables.gather(-1, (slot_idx // bs).to(torch.int64)).to(torch.int64)
        write_index = blocks * bs + slot_idx % bs
        pos = query_positions.to(self.device)
        L, H = self.num_layers, self.num_kv_heads
        pos_rows = self.positions[slot_t, :, :, : max_nb * bs]  # [S, L, H, max_nb*bs] copy
        pos_rows.scatter_(-1, slot_idx, pos[:, None, None, :].expand(S, L, H, Q).to(torch.int32))
        self.positions[slot_t, :, :, : max_nb * bs] = pos_rows
        self.lengths[slot_t] = new_len
        self.host_lengths[slots] = new_len_h
        for s in slots:
            self.tokens_seen[s] += Q
        return AppendPlan(slot_t, write_index, tables, new_len, pos.to(torch.int64), pos_rows, list(slots),
                          host_lengths=new_len_h)

    def prepare_appends(self, groups: list[tuple[list[int], torch.Tensor]]) -> list[AppendPlan]:
        """prepare_append for each (slots, query_positions [S_g, Q_g]) group of one ragged step, as one step (a
        codec's cache packs once, before any of them)."""
        return [PagedKVCache.prepare_append(self, slots, qpos) for slots, qpos in groups]

    def write(self, layer: int, plan: AppendPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer. k, v: [S, H, Q, D]."""
        rows = plan.write_index[:, layer].reshape(-1)
        D = self.head_dim
        self.k_pool.view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.dtype, copy=False))
        self.v_pool.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.dtype, copy=False))

    # ------------------------------------------------------------------ reading
    def attend(self, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, *, backend,
               return_key_scores: bool = False, rotate_keys=None, causal: bool = True):
        """Attention of q [S, Hq, Q, D] over this layer's cached tokens (after this step's write), computed by
        `backend` (a kvbench.runtime.backends.base.AttentionBackend).

        A storage codec's cache overrides this to read (dequantize) its own block layout."""
        return backend.attend(
            q, self.k_pool, self.v_pool, plan.tables[:, layer], plan.lengths[:, layer],
            plan.positions[:, layer], plan.query_positions, scale,
            return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal,
        )

    def layer_tables(self, layer: int, slots: torch.Tensor):
        """(tables [S, H, MB] int32, lengths [S, H] int64, positions [S, H, MB*bs] int32) of one layer."""
        return self.tables[slots, layer], self.lengths[slots, layer], self.positions[slots, layer]

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense K, V [H, T, D] and positions [H, T] of one sequence's layer (T = longest head; pad = -1)."""
        lengths = self.lengths[slot, layer]
        T = int(self.host_lengths[slot, layer].max())  # from the host copy: no device read
        nb = -(-T // self.block_size)
        idx = self.tables[slot, layer, :, :nb].to(torch.int64)  # [H, nb]
        H, D = self.num_kv_heads, self.head_dim
        k = self.k_pool[idx].reshape(H, nb * self.block_size, D)[:, :T]
        v = self.v_pool[idx].reshape(H, nb * self.block_size, D)[:, :T]
        pad = torch.arange(T, device=self.device)[None, :] >= lengths[:, None]
        pos = torch.where(pad, -1, self.positions[slot, layer, :, :T])
        return k, v, pos

    # ------------------------------------------------------------------ eviction
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
            kf, vf = self.k_pool.view(-1, D), self.v_pool.view(-1, D)
            kf[dst_rows] = kf[src_rows]  # gathered first, so overlapping moves are safe
            vf[dst_rows] = vf[src_rows]
        pos_row = self.positions[slot, layer]
        new_pos = pos_row.gather(-1, k_src.to(torch.int64))
        pos_row[:, :n] = torch.where(valid, new_pos, torch.full_like(new_pos, -1))
        self._release_tail_blocks(table, old_len, new_len)
        self.lengths[slot, layer] = new_len
        self.host_lengths[slot, layer] = new_len.cpu().numpy()

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
        width = max(-(-n // bs) for n in lengths)
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
        nb = -(-n // bs)
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

    def _split_full_blocks(self, n: int, block_indices: list[int]) -> tuple[list[int], list[int]]:
        """(blocks to drop, sorted; blocks kept, in order) of an n-token table; only full blocks may be dropped."""
        bs = self.block_size
        nb = -(-n // bs)
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

    # ------------------------------------------------------------------ rollback (speculative decoding)
    def truncate(self, slot: int, num_tokens: int) -> int:
        """Roll sequence `slot` back to its tokens at positions < num_tokens: every later slot (they are the newest
        of each table: slot order is position order) leaves every layer and kv-head table, and the blocks emptied go
        back to the pool at once. Nothing is moved or written. Returns the blocks freed. (Speculative decoding:
        the rejected draft tokens' slots.)"""
        self._check_live(slot)
        bs = self.block_size
        pos = self.positions[slot]  # [L, H, MB*bs] (slots past a table's length may hold stale positions)
        old_len = self.lengths[slot].clone()  # [L, H]
        slots = torch.arange(pos.shape[-1], device=self.device)
        valid = slots < old_len.unsqueeze(-1)
        kept = valid & (pos < num_tokens)
        new_len = kept.sum(-1)  # [L, H]
        if not bool((kept == (slots < new_len.unsqueeze(-1))).all()):
            raise ValueError(f"truncate: sequence {slot}'s tokens at positions >= {num_tokens} are not its newest")
        if self.tokens_seen[slot] > num_tokens:
            self.tokens_seen[slot] = num_tokens
        if bool((new_len == old_len).all()):
            return 0
        old_nb, new_nb = self._num_blocks(old_len), self._num_blocks(new_len)  # [L, H]
        cols = torch.arange(self.tables.shape[-1], device=self.device)
        drop = (cols >= new_nb.unsqueeze(-1)) & (cols < old_nb.unsqueeze(-1))  # [L, H, MB]
        freed = self.tables[slot][drop].tolist()
        self.positions[slot].masked_fill_(valid & ~kept, -1)
        self.lengths[slot] = new_len
        self.host_lengths[slot] = new_len.cpu().numpy()  # the host copy follows every change
        self.pool.free(freed)
        return len(freed)

    def append_horizon(self, slot: int) -> int:
        """How many tokens one step may append to `slot` and still compute exactly what that many one-token steps
        would (a codec's cache packs blocks between steps; full precision: no limit)."""
        return 1 << 30

    # ------------------------------------------------------------------ block bytes (swap space)
    def block_payload(self, ids: list[int]) -> list[torch.Tensor]:
        """The bytes of blocks `ids`, in this cache's layout (copies): what swap space moves to host memory."""
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return [self.k_pool[idx], self.v_pool[idx]]

    def block_payload_bytes(self, ids: list[int]) -> int:
        return len(ids) * self.bytes_per_block

    def allocate_like(self, ids: list[int]) -> list[int]:
        """Fresh blocks of the same kinds as `ids` (all alike here), one each; all or nothing."""
        return self.pool.allocate(len(ids))

    def write_block_payload(self, ids: list[int], payload: list[torch.Tensor]) -> None:
        """Store block_payload's tensors into blocks `ids` (bit for bit)."""
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.k_pool[idx] = payload[0]
        self.v_pool[idx] = payload[1]

    # ------------------------------------------------------------------ pool accounting (for the scheduler)
    def free_blocks(self) -> int:
        """New blocks an append could get now."""
        return self.pool.num_free

    def capacity_blocks(self) -> int:
        """Blocks the pool can hand out in all."""
        return self.pool.capacity

    def blocks_in_use_now(self) -> int:
        return self.pool.in_use

    def blocks_for_append(self, slots: list[int | None], n_tokens: int) -> int:
        """Blocks that appending n_tokens to each sequence of `slots` (None: a new, empty one) allocates."""
        fresh = sum(1 for s in slots if s is None)
        bs = self.block_size
        total = fresh * blocks_for_tokens(n_tokens, bs) * self.num_layers * self.num_kv_heads
        live = [s for s in slots if s is not None]
        if live:
            old = self.host_lengths[live]  # [S, L, H]
            total += int((blocks_for_tokens(old + n_tokens, bs) - blocks_for_tokens(old, bs)).sum())
        return total

    def blocks_held(self, slot: int) -> int:
        """Blocks in the tables of one sequence (shared blocks counted once per table)."""
        return int(blocks_for_tokens(self.host_lengths[slot], self.block_size).sum())

    # ------------------------------------------------------------------ internals
    def _num_blocks(self, lengths: torch.Tensor) -> torch.Tensor:
        return blocks_for_tokens(lengths, self.block_size)

    def _check_live(self, slot: int) -> None:
        if slot not in self.live:
            raise KeyError(f"sequence slot {slot} is not live")

    def _release_tail_blocks(self, table: torch.Tensor, old_len: torch.Tensor, new_len: torch.Tensor) -> None:
        old_nb, new_nb = self._num_blocks(old_len), self._num_blocks(new_len)
        freed: list[int] = []
        for h in range(table.shape[0]):
            a, b = int(new_nb[h]), int(old_nb[h])
            if b > a:
                freed.extend(table[h, a:b].tolist())
        self.pool.free(freed)

    def _copy_on_write_targets(self, tables: torch.Tensor, old_len: torch.Tensor):
        """(flat table rows, columns) of partly filled last blocks that another sequence also holds."""
        partial = (old_len % self.block_size) != 0
        if not bool(partial.any()):
            return None
        col = (old_len // self.block_size).flatten()
        flat = tables.view(-1, tables.shape[-1])
        rows = torch.nonzero(partial.flatten()).flatten()
        ids = flat[rows, col[rows]].tolist()  # one host copy, not one per (sequence, layer, head) row
        refcount = self.pool.refcount
        shared = [r for r, b in zip(rows.tolist(), ids) if refcount(b) > 1]
        if not shared:
            return None
        r = torch.tensor(shared, dtype=torch.int64, device=self.device)
        return r, col[r]

    def _apply_copy_on_write(self, tables: torch.Tensor, cow, new_ids: list[int]) -> None:
        rows, cols = cow
        flat = tables.view(-1, tables.shape[-1])
        old = flat[rows, cols].to(torch.int64)
        new = torch.tensor(new_ids, dtype=torch.int64, device=self.device)
        self.k_pool[new] = self.k_pool[old]
        self.v_pool[new] = self.v_pool[old]
        flat[rows, cols] = new.to(torch.int32)
        self.pool.free(old.tolist())

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
                    (nid,) = self.pool.allocate(1)
                    self.k_pool[nid] = self.k_pool[b]
                    self.v_pool[nid] = self.v_pool[b]
                    table[h, c] = nid
                    self.pool.free([b])

    def _grow_blocks(self, needed: int) -> None:
        new_mb = max(needed, 2 * self.max_blocks)
        pad = new_mb - self.max_blocks
        self.tables = torch.nn.functional.pad(self.tables, (0, pad))
        self.positions = torch.nn.functional.pad(self.positions, (0, pad * self.block_size), value=-1)
        self.max_blocks = new_mb

    def _grow_seqs(self) -> None:
        old = self.max_seqs
        new = 2 * old
        self.tables = torch.cat([self.tables, torch.zeros_like(self.tables)])
        self.lengths = torch.cat([self.lengths, torch.zeros_like(self.lengths)])
        self.host_lengths = np.concatenate([self.host_lengths, np.zeros_like(self.host_lengths)])
        self.positions = torch.cat([self.positions, torch.full_like(self.positions, -1)])
        self.tokens_seen += [0] * old
        self._free_slots = list(range(new - 1, old - 1, -1)) + self._free_slots
        self.max_seqs = new


def _table_entries(tables: torch.Tensor, num_blocks: torch.Tensor) -> list[int]:
    """Block ids of the first num_blocks[l, h] entries of tables[l, h, :] (any leading shape)."""
    mb = tables.shape[-1]
    mask = torch.arange(mb, device=tables.device) < num_blocks.unsqueeze(-1)
    return tables[mask].tolist()
