"""A paged KV cache that stores key-channel-pruned blocks in fewer bytes (ThinK, `prune_key_channels`).

The two pools of QuantizedPagedKVCache in one id space, with PrunedKeyRows as the packed layout:

    fp pool      k_pool, v_pool [num_blocks, block_size, head_dim]    model dtype: new tokens, and every block not
                                                                      pruned (a prompt's last, partly filled block;
                                                                      tokens generated after the prompt)
    packed pool  kq_pool [n, bs x kept x e + kept x index bytes], vq_pool [n, bs x D x e] uint8: a full block of
                 pruned keys in its kept channels (and their indices), its values whole

Nothing is packed by a rule (`pack_pending` packs nothing): a method calls `prune_key_channels(layer, slot, pruned
[H, P])` once a prompt is in the cache, and that layer's full blocks of that sequence become packed rows that keep
each kv-head's D - P other channels (the full-precision blocks are freed before the rows are allocated, so pruning
never raises the bytes in use); the pruned channels of the tokens left in a partly filled full-precision block are
written as zeros. Tokens appended later keep full keys (kvpress's ThinKPress prunes the prompt only) until a later
prompt end prunes again (streamed scoring), which zeroes the new channels in every held token as well. Reading
decodes the rows with zeros in the pruned channels, so attention computes what it computes over zeroed keys.
Token-level eviction after pruning keeps the blocks that stay put as they are and stores the tokens it moves again:
a full block whose keys are all zero in its kv-head's latest pruned channels (pruned tokens only) as a packed row,
any other (with a generated token, or a partly filled one) in full precision, its pruned channels still zero.
Whole-block eviction moves nothing. Bytes (`peak_kv_bytes` and the rest)
are counted from both pools, as for any codec cache.

A block that forks share is packed for the pruning table alone: that table's reference is dropped and
it gets its own row; the other holders keep the full-precision block as it was.
"""
from __future__ import annotations

import torch

from kvbench.runtime.cache.kv_geometry import blocks_for_tokens
from kvbench.runtime.cache.pruned_key_rows import PrunedKeyRows
from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache


class PrunedKeyKVCache(QuantizedPagedKVCache):
    """QuantizedPagedKVCache whose packed rows are key-channel-pruned blocks (`pruned_channels` of head_dim)."""

    def __init__(self, *, pruned_channels: int, head_dim: int, dtype: torch.dtype = torch.float32, **kwargs):
        if not 0 < pruned_channels < head_dim:
            raise ValueError(f"pruned_channels must be in [1, {head_dim - 1}], got {pruned_channels}")
        self.pruned_channels = int(pruned_channels)
        self._latest: dict[tuple[int, int], torch.Tensor] = {}  # (slot, layer) -> the latest pruned channels [H, P]
        rows = PrunedKeyRows(head_dim, head_dim - pruned_channels, dtype)
        super().__init__(codec=rows, head_dim=head_dim, dtype=dtype, **kwargs)

    def pack_pending(self, slots: list[int] | None = None) -> int:
        """No packing rule: blocks are packed by prune_key_channels only."""
        self.free_pending_now()
        return 0

    def append_horizon(self, slot: int) -> int:
        return 1 << 30

    def describe_storage(self) -> dict:
        out = super().describe_storage()
        out["pruned_key_channels"] = self.pruned_channels
        return out

    @torch.no_grad()
    def prune_key_channels(self, layer: int, slot: int, pruned: torch.Tensor) -> None:
        """Prune key channels `pruned` [H, P] (each kv-head's own) of every token one sequence's layer holds: its
        full-precision full blocks become packed rows of the other channels, the pruned channels of a partly
        filled block are zeroed, and a block packed by an earlier call (a later chunk that ends a prompt again:
        streamed scoring) gets these channels zeroed too, so every held token's keys are zero in the union of
        the channels pruned so far (kvpress zeroes the whole layer's keys each time it compresses)."""
        self._check_live(slot)
        H, D, bs = self.num_kv_heads, self.head_dim, self.block_size
        pruned = pruned.to(self.device, torch.int64)
        if tuple(pruned.shape) != (H, self.pruned_channels):
            raise ValueError(f"prune_key_channels: expected [{H}, {self.pruned_channels}] channels, got "
                             f"{list(pruned.shape)}")
        self._latest[slot, layer] = pruned
        lengths = self.host_lengths[slot, layer].tolist()  # [H]
        table = self.tables[slot, layer]  # [H, MB] view
        width = max(blocks_for_tokens(n, bs) for n in lengths) if lengths else 0
        rows = table[:, :width].tolist()
        heads, cols, ids = [], [], []  # the full-precision full blocks to pack
        for h, n in enumerate(lengths):
            for c in range(blocks_for_tokens(n, bs)):
                b = rows[h][c]
                if b >= self.num_fp_blocks:
                    self._zero_packed_channels(table, h, c, pruned[h])
                elif (c + 1) * bs <= n:
                    heads.append(h)
                    cols.append(c)
                    ids.append(b)
                else:  # the partly filled last block stays full precision
                    self._zero_channels(table, h, c, pruned[h])
        self._pack_blocks(table, heads, cols, ids, pruned)

    @torch.no_grad()
    def keep_tokens(self, layer: int, slot: int, keep: torch.Tensor) -> None:
        """QuantizedPagedKVCache.keep_tokens (moved tokens are stored again in full-precision blocks), then every
        full-precision full block of the layer whose keys are exactly zero in its kv-head's latest pruned channels
        (pruned tokens moved by this eviction; never a generated token's block, whose keys are not zero there) is
        packed again with those channels left out: lossless, so a decode-time eviction keeps the saving."""
        super().keep_tokens(layer, slot, keep)
        pruned = self._latest.get((slot, layer))
        if pruned is None:
            return
        bs = self.block_size
        lengths = self.host_lengths[slot, layer].tolist()  # [H]
        table = self.tables[slot, layer]  # [H, MB] view
        width = max(blocks_for_tokens(n, bs) for n in lengths) if lengths else 0
        rows = table[:, :width].tolist()
        heads, cols, ids = [], [], []
        for h, n in enumerate(lengths):
            for c in range(n // bs):
                if rows[h][c] < self.num_fp_blocks:
                    heads.append(h)
                    cols.append(c)
                    ids.append(rows[h][c])
        if not ids:
            return
        fid = torch.tensor(ids, dtype=torch.int64, device=self.device)
        ch = pruned[torch.tensor(heads, dtype=torch.int64, device=self.device)]  # [n, P]
        keys = self.k_pool[fid]  # [n, bs, D]
        zero = (keys.gather(-1, ch[:, None, :].expand(-1, bs, -1)) == 0).flatten(1).all(1).tolist()  # [n]
        sel = [i for i, z in enumerate(zero) if z]
        self._pack_blocks(table, [heads[i] for i in sel], [cols[i] for i in sel], [ids[i] for i in sel], pruned)

    def _pack_blocks(self, table: torch.Tensor, heads: list[int], cols: list[int], ids: list[int],
                     pruned: torch.Tensor) -> None:
        """Pack the full-precision blocks `ids` (column cols[i] of table row heads[i]) into rows that leave out
        their head's channels pruned [H, P]; their table references are dropped first, so packing never raises
        the bytes in use (a block other tables share stays theirs)."""
        if not ids:
            return
        H, D = self.num_kv_heads, self.head_dim
        keep_mask = torch.ones(H, D, dtype=torch.bool, device=self.device)
        keep_mask.scatter_(1, pruned, False)
        kept = keep_mask.nonzero()[:, 1].view(H, D - self.pruned_channels)  # [H, kept] ascending
        fid = torch.tensor(ids, dtype=torch.int64, device=self.device)
        head_t = torch.tensor(heads, dtype=torch.int64, device=self.device)
        k_rows = self.codec.encode_key_rows(self.k_pool[fid], kept[head_t])
        v_rows = self.codec.encode_value_rows(self.v_pool[fid])
        self._check_room(0, len(ids), ids)
        tags = self.pool.tags_of(ids)  # the same kind (with a key summary or not)
        self.pool.free(ids)
        new_ids = self._allocate_packed(len(ids), tags)
        pid = torch.tensor(new_ids, dtype=torch.int64, device=self.device) - self.num_fp_blocks
        self.kq_pool[pid] = k_rows
        self.vq_pool[pid] = v_rows
        table[head_t, torch.tensor(cols, dtype=torch.int64, device=self.device)] = torch.tensor(
            new_ids, dtype=table.dtype, device=self.device)

    # ------------------------------------------------------------------ per-sequence state: the latest channels
    def free_sequence(self, slot: int) -> None:
        for key in [k for k in self._latest if k[0] == slot]:
            del self._latest[key]
        super().free_sequence(slot)

    def fork(self, slot: int) -> int:
        child = super().fork(slot)
        for (s, layer), pruned in list(self._latest.items()):
            if s == slot:
                self._latest[child, layer] = pruned
        return child

    def _zero_packed_channels(self, table: torch.Tensor, head: int, col: int, channels: torch.Tensor) -> None:
        """Zero `channels` of the keys in packed block `col` of table row `head`, in place in its row (a private
        row first if it is shared); its kept channels stay as they are."""
        b = int(table[head, col])
        p = b - self.num_fp_blocks
        bs, D = self.block_size, self.head_dim
        row = self.kq_pool[p: p + 1]
        keys = self.codec.decode_keys(row, bs, D, dtype=self.dtype)  # [1, bs, D]
        own = self.codec.row_channels(row)  # [1, kept]
        if not bool(keys[..., channels].any()):
            return  # nothing left to zero
        keys[..., channels] = 0
        new_row = self.codec.encode_key_rows(keys, own)
        if self.pool.refcount(b) > 1:
            self._check_room(0, 1, [])
            (nid,) = self._allocate_packed(1, self.pool.tags_of((b,)))
            self.vq_pool[nid - self.num_fp_blocks] = self.vq_pool[p]
            self.pool.free([b])
            table[head, col] = nid
            p = nid - self.num_fp_blocks
        elif self.block_listeners:
            self._modifying([b])
        self.kq_pool[p] = new_row[0]

    def _zero_channels(self, table: torch.Tensor, head: int, col: int, channels: torch.Tensor) -> None:
        """Zero `channels` of the keys in block `col` of table row `head` (a private copy first if it is shared)."""
        b = int(table[head, col])
        if self.pool.refcount(b) > 1:
            (nid,) = self.pool.allocate(1, self.pool.tags_of((b,)))
            self.k_pool[nid] = self.k_pool[b]
            self.v_pool[nid] = self.v_pool[b]
            table[head, col] = nid
            self.pool.free([b])
            b = nid
        elif self.block_listeners:
            self._modifying([b])
        self.k_pool[b][:, channels] = 0
