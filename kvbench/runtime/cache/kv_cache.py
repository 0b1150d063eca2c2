"""Paged KV cache: one block pool, block tables per sequence, per layer and per kv-head.

Layout (nano-vllm style, but one table per (sequence, layer, kv-head) so methods may keep
different tokens in different layers and heads):

    k_pool, v_pool: [num_blocks, block_size, head_dim]     the bytes (one block = one table's slots)
    tables:         [max_seqs, L, H, max_blocks] int32     physical block ids, in slot order
    lengths:        [max_seqs, L, H] int64                 valid slots per table
    host_lengths:   numpy int64 [max_seqs, L, H]           the same, kept on the host by every operation that
                                                           changes a length, so allocation reads no device value
    positions:      [max_seqs, L, H, max_blocks*bs] int32  original token position of each slot
    position_shift: list[int] [max_seqs]                   how far a sequence's next positions lag its token count
                                                           (0 unless its method re-indexed the kept tokens:
                                                           continue_positions_at)

Tables are kept compact: slots 0..len-1 are valid and every block but the last is full, so a
table of n tokens holds exactly ceil(n / block_size) blocks. Evicted blocks return to the pool at
once. Slot order is original-position order (appends go to the end; eviction keeps order).
"""
from __future__ import annotations

import numpy as np
import torch

from kvbench.runtime.backends.base import DecodePools
from kvbench.runtime.cache.append_plan import AppendPlan
from kvbench.runtime.cache.block_summaries import BlockSummaries
from kvbench.runtime.cache.kv_accounting import KVAccounting
from kvbench.runtime.cache.kv_eviction import KVEviction
from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCK, blocks_for_tokens
from kvbench.runtime.cache.kv_layout import FullPrecisionLayout
from kvbench.runtime.cache.kv_meter import DecodeReads
from kvbench.runtime.cache.page_retrieval import PageRetrieval

__all__ = ["SCRATCH_BLOCK", "AppendPlan", "PagedKVCache"]


class PagedKVCache(KVEviction, KVAccounting, FullPrecisionLayout):
    """Block tables over a preallocated K/V pool for a set of live sequences.

    Its concerns, one module each: the tables, allocation, copy-on-write, forks and rollback (here); the eviction
    operations a method may call and the pending frees (kv_eviction); bytes and blocks (kv_accounting); the bytes'
    layout, written, read and moved (kv_layout)."""

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int = 16, num_blocks: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", max_seqs: int = 64,
                 initial_max_blocks: int = 64, store_pre_rope: bool = False, value_dim: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if value_dim is not None and not 0 < value_dim <= head_dim:
            raise ValueError(f"value_dim={value_dim} must be in 1..head_dim={head_dim}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        # a latent cache (MLA): values are the first value_dim dims of each key row (kv_layout)
        self.value_dim, self.latent = value_dim, value_dim is not None
        self.block_size = block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.store_pre_rope = store_pre_rope
        self.summaries: BlockSummaries | None = None  # per-block min / max keys (enable_page_retrieval)
        # [L] 1 for a layer that retrieves pages: its blocks keep key summaries (tagged in the pool as allocated)
        self.summary_layers = np.zeros(num_layers, dtype=np.uint8)
        self.decode_reads = DecodeReads()  # blocks the decode steps' attention read (kv_meter)
        self.page_retrieval: PageRetrieval | None = None  # decode steps read selected blocks (enable_page_retrieval)
        self._make_storage(num_blocks)
        self.max_seqs = max_seqs
        self.max_blocks = initial_max_blocks
        L, H = num_layers, num_kv_heads
        self.tables = torch.zeros(max_seqs, L, H, self.max_blocks, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(max_seqs, L, H, dtype=torch.int64, device=self.device)
        self.host_lengths = np.zeros((max_seqs, L, H), dtype=np.int64)
        self.positions = torch.full((max_seqs, L, H, self.max_blocks * block_size), -1, dtype=torch.int32,
                                    device=self.device)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self.live: set[int] = set()
        # forks a method's own pass runs on (Engine.fork_sequence(scratch=True), KVzip's reconstruction): their
        # blocks count in the pool as any, but they are no sequence of the workload (left out of full_kv_bytes)
        self.scratch_slots: set[int] = set()
        self.tokens_seen = [0] * max_seqs  # tokens appended to each sequence (before any eviction)
        # tokens appended to a sequence take positions (their index in it) - position_shift[slot]: 0 unless the
        # method re-indexed the kept prompt (continue_positions_at, kvpress's pipeline after FinchPress)
        self.position_shift = [0] * max_seqs
        self._shared = False  # set once any fork happened: enables copy-on-write checks
        self.block_listeners: list = []  # objects with modified(ids) / replace(old, new) (the prefix cache)
        self._pending_free: list[torch.Tensor] = []  # evicted block ids not yet back in the pool (device)
        self.host_decode_appends = True  # decode appends on CPU built with numpy (_prepare_decode_append_host)
        # evict_blocks_on_device leaves the ids on the device until take_pending_frees (an engine sets this: it
        # takes them with each step's sampled tokens); False: they go back to the pool at once (a host read)
        self.defer_frees = False

    def decode_pools(self) -> DecodePools:
        """The fused decode step's view of this cache (kvbench.runtime.backends.base.DecodePools): kept, its
        settings read again at each call."""
        view = self.__dict__.get("_decode_pools")
        if view is None:
            view = self._decode_pools = DecodePools(
                k_pool=self.k_pool, v_pool=self.v_pool, block_size=self.block_size, head_dim=self.head_dim,
                num_kv_heads=self.num_kv_heads, dtype=self.dtype, plain=self.plain_pools,
                store_pre_rope=self.store_pre_rope, kv_block_bytes=self.kv_block_bytes, **self._packed_pools())
        view.store_pre_rope, view.summaries = self.store_pre_rope, self.summaries
        return view

    def _packed_pools(self) -> dict:
        """A codec cache's part of its DecodePools view (its codec and packed pools); none for plain pools."""
        return {}

    def enable_page_retrieval(self, retrieval: PageRetrieval) -> None:
        """Decode steps read only the blocks `retrieval` selects (page_retrieval.py): from now on, before any token
        is written, the blocks of the layers that retrieve pages keep their element-wise min / max key
        (block_summaries.py). Those blocks are tagged as they are allocated and their summaries count with their
        K/V in the pool's bytes; a block of another layer (dense, sliding) costs its K/V only."""
        if self.pool.in_use:
            raise ValueError("enable_page_retrieval: the cache already holds tokens")
        if self.store_pre_rope:
            raise ValueError("page retrieval needs keys cached after RoPE (store_pre_rope=False)")
        self.summary_layers = np.array([retrieval.pages_for(layer) > 0 for layer in range(self.num_layers)],
                                       dtype=np.uint8)
        if self.summaries is None:
            self.summaries = BlockSummaries(self.pool.num_blocks, self.block_size, self.head_dim, self.device)
            self._count_summary_bytes()
        self.page_retrieval = retrieval

    def summarizes(self, layer: int) -> bool:
        """Whether the blocks of `layer` keep key summaries (page retrieval on, and the layer retrieves pages)."""
        return self.summaries is not None and bool(self.summary_layers[layer])

    def _layer_tags(self, layers) -> list[int] | None:
        """BlockPool.allocate's tags for new blocks of `layers` (one layer index per block): 1 where the layer keeps
        summaries; None without page retrieval (the pool's default: none)."""
        if self.summaries is None:
            return None
        return self.summary_layers[np.asarray(layers, dtype=np.int64)].tolist()

    def _count_summary_bytes(self) -> None:
        """The summaries are memory: a tagged block costs its K/V and its summary, any other its K/V (the pool counts
        each kind; a codec's pool likewise for both kinds of its blocks)."""
        kv = self.kv_block_bytes
        self.pool.set_block_bytes(kv, kv + self.summaries.bytes_per_block, default_tag=1)

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
        self.position_shift[s] = 0
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
        self.scratch_slots.discard(slot)
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
        self.position_shift[child] = self.position_shift[slot]
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

    # ------------------------------------------------------------------ appending
    def refresh_plan_layer(self, plan: AppendPlan, layer: int) -> None:
        """Re-snapshot one layer of `plan` (tables, lengths, key positions, host lengths) from the cache after an
        eviction inside the step (a method acting before the layer's attention); the other layers are untouched."""
        nb = plan.tables.shape[-1]
        plan.tables[:, layer] = self.tables[plan.slots, layer, :, :nb]
        plan.lengths[:, layer] = self.lengths[plan.slots, layer]
        positions = plan.positions  # [S, L, H, nb*bs] (taken now if it was lazy)
        positions[:, layer] = self.positions[plan.slots, layer, :, : positions.shape[-1]]
        if plan.host_lengths is not None:
            plan.host_lengths[:, layer] = self.host_lengths[plan.slot_list, layer]

    def prepare_append(self, slots: list[int], query_positions: torch.Tensor) -> AppendPlan:
        """Allocate room for Q new tokens in every layer/head table of each sequence.

        query_positions: [S, Q] the new tokens' indices in their sequences (their original positions); a sequence
        whose positions continue elsewhere (continue_positions_at) gets them lowered by its shift here, so the
        plan, its RoPE and its cached positions all carry the positions the model sees. Returns the flat pool rows
        each layer writes to. Raises OutOfBlocksError (nothing changed) if the pool is too small.
        """
        bs = self.block_size
        S, Q = query_positions.shape
        query_positions = self._shifted(slots, query_positions)
        self.free_pending_now()  # evicted ids a caller did not take (it sampled nothing): back before allocating
        for s in slots:
            self._check_live(s)
        if Q == 1 and self.device.type == "cpu" and not self._shared and self.host_decode_appends:
            return self._noted(self._prepare_decode_append_host(slots, query_positions))
        slot_t = torch.tensor(slots, dtype=torch.int64, device=self.device)
        # block counts from the host copy of the lengths: allocating reads no device value
        old_len_h = self.host_lengths[slots]  # [S, L, H]
        new_len_h = old_len_h + Q
        old_nb_h = blocks_for_tokens(old_len_h, bs)
        new_nb_h = blocks_for_tokens(new_len_h, bs)
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
        rows_h = np.repeat(np.arange(need_h.size), need_h)  # the (sequence, layer, kv-head) row of each new block
        tags = None
        if self.summaries is not None:  # a block is tagged by its layer: row // H % L
            rows_all = rows_h if not n_cow else np.concatenate([rows_h, cow[0].cpu().numpy()])
            tags = self._layer_tags(rows_all // self.num_kv_heads % self.num_layers)
        ids = self.pool.allocate(total + n_cow, tags)
        if n_cow:
            self._apply_copy_on_write(tables, cow, ids[total:])
        if total:
            ids_t = torch.tensor(ids[:total], dtype=torch.int32, device=self.device)
            # fresh blocks start zeroed: masked slots of a partly filled block must not hold NaN/inf
            self.k_pool.index_fill_(0, ids_t.to(torch.int64), 0)
            self.v_pool.index_fill_(0, ids_t.to(torch.int64), 0)
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
        # the new slots' positions written in place (S*L*H*Q values), then the plan's snapshot of the rows in use
        layer_idx = torch.arange(L, device=self.device)[None, :, None, None]
        head_idx = torch.arange(H, device=self.device)[None, None, :, None]
        self.positions[slot_t[:, None, None, None], layer_idx, head_idx, slot_idx] = \
            pos[:, None, None, :].expand(S, L, H, Q).to(torch.int32)
        positions_snapshot = lambda: self.positions[slot_t, :, :, : max_nb * bs]  # noqa: E731  [S, L, H, max_nb*bs]
        self.lengths[slot_t] = new_len
        self.host_lengths[slots] = new_len_h
        for s in slots:
            self.tokens_seen[s] += Q
        return self._noted(AppendPlan(slot_t, write_index, tables, new_len, pos.to(torch.int64), positions_snapshot,
                                      list(slots), host_lengths=new_len_h))

    def _prepare_decode_append_host(self, slots: list[int], query_positions: torch.Tensor) -> AppendPlan:
        """prepare_append of one token per sequence on a CPU cache with no shared blocks: the same plan, built with
        numpy on views of the tables. After a decode step's weights have flushed the caches, each of the general
        path's two dozen small torch ops costs tens of microseconds; numpy on views costs a fraction of that (the
        figures: docs/benchmark-results.md)."""
        bs = self.block_size
        sl = np.asarray(slots, dtype=np.int64)  # [S]
        old_len_h = self.host_lengths[sl]  # [S, L, H]
        new_len_h = old_len_h + 1
        max_nb = int(blocks_for_tokens(new_len_h, bs).max())
        if max_nb > self.max_blocks:
            self._grow_blocks(max_nb)
        need = old_len_h % bs == 0  # the table's last block is full (or it has none): one new block
        total = int(np.count_nonzero(need))
        s_i, l_i, h_i = np.nonzero(need)  # row-major, the general path's allocation order
        ids = self.pool.allocate(total, self._layer_tags(l_i))
        tables_np = self.tables.numpy()  # views: the cache's own tensors, written in place
        lengths_np, positions_np = self.lengths.numpy(), self.positions.numpy()
        si = sl[:, None, None]  # [S, 1, 1]
        li = np.arange(self.num_layers)[None, :, None]  # [1, L, 1]
        hi = np.arange(self.num_kv_heads)[None, None, :]  # [1, 1, H]
        if total:
            ids_t = torch.tensor(ids, dtype=torch.int64)
            # fresh blocks start zeroed: masked slots of a partly filled block must not hold NaN/inf
            self.k_pool.index_fill_(0, ids_t, 0)
            self.v_pool.index_fill_(0, ids_t, 0)
            tables_np[sl[s_i], l_i, h_i, old_len_h[s_i, l_i, h_i] // bs] = ids_t.numpy()
        old_len = lengths_np[sl]  # [S, L, H]
        write_index = tables_np[si, li, hi, old_len // bs].astype(np.int64) * bs + old_len % bs  # [S, L, H]
        pos = query_positions.reshape(-1).numpy().astype(np.int64)  # [S]
        positions_np[si, li, hi, old_len] = pos[:, None, None]
        new_len = old_len + 1
        lengths_np[sl] = new_len
        self.host_lengths[sl] = new_len_h
        for s in slots:
            self.tokens_seen[s] += 1
        slot_t = torch.from_numpy(sl)
        positions_snapshot = lambda: self.positions[slot_t, :, :, : max_nb * bs]  # noqa: E731  [S, L, H, max_nb*bs]
        return AppendPlan(slot_t, torch.from_numpy(write_index[..., None]),
                          torch.from_numpy(tables_np[sl, :, :, :max_nb]), torch.from_numpy(new_len),
                          torch.from_numpy(pos[:, None]), positions_snapshot, list(slots),
                          host_lengths=new_len_h)

    def _shifted(self, slots: list[int], query_positions: torch.Tensor) -> torch.Tensor:
        """query_positions [S, Q] less each sequence's position_shift (the tensor itself when none is shifted)."""
        shift = [self.position_shift[s] for s in slots]
        if not any(shift):
            return query_positions
        return query_positions - torch.tensor(shift, dtype=query_positions.dtype,
                                              device=query_positions.device).unsqueeze(1)

    def continue_positions_at(self, slot: int, next_position: int) -> None:
        """The next token appended to `slot` takes position `next_position` and the later ones follow it (instead
        of their index in the sequence): kvpress's pipeline after a press that re-rotated the kept keys to
        0..n-1 continues at n (FinchPress, KeyRerotationPress). Tokens already cached keep what they store."""
        self._check_live(slot)
        shift = self.tokens_seen[slot] - int(next_position)
        if shift < 0:
            raise ValueError(f"continue_positions_at: position {next_position} is past sequence {slot}'s "
                             f"{self.tokens_seen[slot]} tokens")
        self.position_shift[slot] = shift

    def prepare_appends(self, groups: list[tuple[list[int], torch.Tensor]]) -> list[AppendPlan]:
        """prepare_append for each (slots, query_positions [S_g, Q_g]) group of one ragged step, as one step (a
        codec's cache packs once, before any of them)."""
        return [PagedKVCache.prepare_append(self, slots, qpos) for slots, qpos in groups]

    # ------------------------------------------------------------------ rollback (speculative decoding)
    def truncate(self, slot: int, num_tokens: int) -> int:
        """Roll sequence `slot` back to its first num_tokens tokens (positions < num_tokens, less its
        position_shift): every later slot (they are the newest of each table: slot order is position order) leaves
        every layer and kv-head table, and the blocks emptied go back to the pool at once. Nothing is moved or
        written. Returns the blocks freed. (Speculative decoding: the rejected draft tokens' slots.)"""
        self._check_live(slot)
        bs = self.block_size
        pos = self.positions[slot]  # [L, H, MB*bs] (slots past a table's length may hold stale positions)
        old_len = self.lengths[slot].clone()  # [L, H]
        slots = torch.arange(pos.shape[-1], device=self.device)
        valid = slots < old_len.unsqueeze(-1)
        kept = valid & (pos < num_tokens - self.position_shift[slot])
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
        for layer in range(self.num_layers):  # a last block that kept some of its slots: its min / max without the rest
            if self.summarizes(layer):
                self._summarize_table(layer, slot)
        return len(freed)

    # ------------------------------------------------------------------ internals
    def _num_blocks(self, lengths: torch.Tensor) -> torch.Tensor:
        return blocks_for_tokens(lengths, self.block_size)

    def _check_live(self, slot: int) -> None:
        if slot not in self.live:
            raise KeyError(f"sequence slot {slot} is not live")

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
        if self.summaries is not None:
            self.summaries.copy(new, old)
        flat[rows, cols] = new.to(torch.int32)
        self.pool.free(old.tolist())

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
        self.position_shift += [0] * old
        self._free_slots = list(range(new - 1, old - 1, -1)) + self._free_slots
        self.max_seqs = new


def _table_entries(tables: torch.Tensor, num_blocks: torch.Tensor) -> list[int]:
    """Block ids of the first num_blocks[l, h] entries of tables[l, h, :] (any leading shape)."""
    mb = tables.shape[-1]
    mask = torch.arange(mb, device=tables.device) < num_blocks.unsqueeze(-1)
    return tables[mask].tolist()
