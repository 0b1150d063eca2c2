"""Storing tokens in a codec's packed blocks (kvbench.runtime.cache.quantized_cache): packing the full-precision blocks
that left the codec's window, at the start of every step, and storing the tokens token-level eviction keeps again.

`PackedStorage` is mixed into `QuantizedPagedKVCache`: its tables, lengths, pools and codec are the cache's.
"""
from __future__ import annotations

import numpy as np
import torch

from kvbench.runtime.cache.block_pool import OutOfBlocksError
from kvbench.runtime.cache.kv_geometry import blocks_for_tokens


class PackedStorage:
    """Packing and re-storing of a QuantizedPagedKVCache's blocks, and the room check before either."""

    @torch.no_grad()
    def pack_pending(self, slots: list[int] | None = None) -> int:
        """Encode every full-precision block the codec's rule says should be packed; returns how many.

        Their full-precision blocks are freed before the packed rows are allocated (the data is encoded first),
        so packing never raises the bytes in use.
        """
        self.free_pending_now()
        slots = sorted(self.live) if slots is None else list(slots)
        if not slots or not self._may_need_packing(slots):
            return 0
        n = self._pack(slots)
        for s in slots:  # only once packed: a failed pack is tried again
            self._pack_seen[s] = (self.host_lengths[s].copy(), self.tokens_seen[s])
            self._restored.discard(s)
        return n

    def _pack(self, slots: list[int]) -> int:
        """pack_pending's work over `slots` (live)."""
        st = torch.tensor(slots, dtype=torch.int64, device=self.device)
        tables = self.tables[st]  # [S, L, H, MB]
        lengths = self.lengths[st]  # [S, L, H]
        bs, R = self.block_size, int(self.codec.residual)
        start = 1 if self.codec.first_token_fp else 0
        stop = (lengths - R).clamp(min=0) // bs  # [S, L, H]
        cols = torch.arange(tables.shape[-1], device=self.device)
        mask = (cols >= start) & (cols < stop.unsqueeze(-1)) & (tables < self.num_fp_blocks)
        if not bool(mask.any()):
            return 0
        s_i, l_i, h_i, c_i = mask.nonzero(as_tuple=True)
        all_ids = tables[s_i, l_i, h_i, c_i].to(torch.int64)
        # a block several tables share (fork, prefix cache) is packed once and stays shared
        fp_ids, inverse = torch.unique(all_ids, return_inverse=True)
        first = torch.full((fp_ids.numel(),), all_ids.numel(), dtype=torch.int64, device=self.device)
        first = first.scatter_reduce(0, inverse, torch.arange(all_ids.numel(), device=self.device), "amin")
        l_u, h_u = l_i[first], h_i[first]  # the (layer, head) of each distinct block
        self._check_room(0, fp_ids.numel(), all_ids.tolist())
        if self.codec.layer_independent:  # KIVI, int8, fp8: every layer's blocks in one call
            k_rows = self.codec.encode_keys(self.k_pool[fp_ids].float())
            v_rows = self._encode_values(self.v_pool[fp_ids].float())
        else:  # per-layer levels / ranges (KVQuant)
            k_rows = torch.empty(fp_ids.numel(), self.key_nbytes, dtype=torch.uint8, device=self.device)
            v_rows = torch.empty(fp_ids.numel(), self.value_nbytes, dtype=torch.uint8, device=self.device)
            for layer in torch.unique(l_u).tolist():
                sel = torch.nonzero(l_u == layer).squeeze(1)
                ids, heads = fp_ids[sel], h_u[sel]
                k_rows[sel] = self.codec.encode_keys(self.k_pool[ids].float(), layer, heads)
                v_rows[sel] = self._encode_values(self.v_pool[ids].float(), layer, heads)
        # page retrieval: a retrieving layer's packed block carries a key summary (no host read otherwise)
        tags = self._layer_tags(l_u.tolist()) if self.summaries is not None else None
        new_ids = torch.tensor(self._allocate_packed_for(fp_ids, all_ids.tolist(), tags), dtype=torch.int64,
                               device=self.device)
        extra = torch.bincount(inverse, minlength=fp_ids.numel()) - 1  # more tables holding the same block
        if bool((extra > 0).any()):
            self.pool.share(torch.repeat_interleave(new_ids, extra).tolist())
        pid = new_ids - self.num_fp_blocks
        self.kq_pool[pid] = k_rows
        self.vq_pool[pid] = v_rows
        if self.summaries is not None:  # page retrieval: the retrieving layers' packed blocks' min / max keys, as
            # attention decodes them
            retrieving = torch.from_numpy(self.summary_layers).to(self.device).bool()[l_u]  # [n] per distinct block
            groups = [(0, retrieving)] if self.codec.layer_independent else \
                [(layer, retrieving & (l_u == layer)) for layer in torch.unique(l_u).tolist() if self.summarizes(layer)]
            for layer, chosen in groups:
                sel = torch.nonzero(chosen).squeeze(1)
                if sel.numel():
                    self.summaries.set_full_blocks(new_ids[sel], self._decode("key", k_rows[sel], layer, h_u[sel]))
        self.tables[st[s_i], l_i, h_i, c_i] = new_ids[inverse].to(torch.int32)
        return int(fp_ids.numel())

    def _encode_values(self, tile: torch.Tensor, layer: int = 0, head=0) -> torch.Tensor:
        """The codec's value rows of tile [n, bs, D]; a latent cache's are empty [n, 0] (its values are decoded
        from the rows, packed as keys)."""
        if self.latent:
            return torch.empty(tile.shape[0], 0, dtype=torch.uint8, device=self.device)
        return self.codec.encode_values(tile, layer, head)

    def _may_need_packing(self, slots: list[int]) -> bool:
        """False when, from host numbers alone, no block of `slots` can have entered the packed range since
        pack_pending last looked (so a decode step reads no device value here). After a pack every table's
        blocks [start, stop(length)) are packed; appends raise stop, whole-block evictions keep that true (the
        packed prefix and stop shrink together), so a block is due exactly when stop of the length the table would
        have without its evictions (old length + tokens appended since) passed the old stop. Token-level eviction
        (keep_tokens) stores tokens again: those sequences are checked on the device."""
        bs, R = self.block_size, int(self.codec.residual)
        start = 1 if self.codec.first_token_fp else 0
        for s in slots:
            seen = self._pack_seen.get(s)
            if seen is None or s in self._restored:
                return True
            lens0, tokens0 = seen
            grown = lens0 + (self.tokens_seen[s] - tokens0)  # [L, H] lengths had nothing been evicted
            stop0, stop = np.maximum(lens0 - R, 0) // bs, np.maximum(grown - R, 0) // bs
            if np.any((stop > stop0) & (stop > start)):
                return True
        return False

    def _allocate_packed_for(self, fp_ids: torch.Tensor, table_refs: list[int], tags=None) -> list[int]:
        """Packed blocks for the distinct full-precision blocks fp_ids (`tags`: BlockPool.allocate's): every table
        reference to them is dropped first (freeing them, so packing never raises the bytes in use), then the
        packed blocks are allocated and block listeners (the prefix cache) follow the tokens from the old ids to the
        new ones."""
        old = fp_ids.tolist()
        listeners, self.pool.release_listeners = self.pool.release_listeners, []  # not forgotten: moved
        try:
            self.pool.free(table_refs)
        finally:
            self.pool.release_listeners = listeners
        new = self._allocate_packed(len(old), tags)
        for listener in self.block_listeners:
            listener.replace(old, new)
        return new

    def _allocate_packed(self, n: int, tags=None) -> list[int]:
        return self.pool.allocate_packed(n, tags)

    def _check_room(self, n_fp: int, n_packed: int, freed: list[int]) -> None:
        """Raise OutOfBlocksError before anything changes unless n_fp / n_packed blocks can be allocated once
        `freed` (ids about to be released) are back (each block at its largest size: with a key summary where
        blocks may carry one)."""
        back_fp = back_pk = 0
        for b in freed:
            if self.pool.refcount(b) == 1:
                if b < self.num_fp_blocks:
                    back_fp += 1
                else:
                    back_pk += 1
        for need, sub, back in ((n_fp, self.pool.fp, back_fp), (n_packed, self.pool.packed, back_pk)):
            if need > sub.num_free + back:
                raise OutOfBlocksError(need, sub.num_free + back, sub.capacity)
        pool = self.pool
        net = ((n_fp - back_fp) * pool.fp_block_bound + (n_packed - back_pk) * pool.packed_block_bound)
        if pool.bytes_in_use() + net > pool.max_bytes:
            raise OutOfBlocksError(n_fp + n_packed, pool.free_fp_blocks(), pool.max_bytes // pool.fp_block_bound)

    # ------------------------------------------------------------------ eviction (token level)
    def rewrite_tokens(self, layer: int, slot: int, *, keys: torch.Tensor | None = None,
                       values: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> None:
        """Not on a codec's layout: its packed blocks would have to be re-encoded."""
        raise RuntimeError("rewrite_tokens (re-rotated keys, merged values) needs a full-precision cache; "
                           "this one stores blocks through a codec")

    def prune_key_channels(self, layer: int, slot: int, pruned: torch.Tensor) -> None:
        """Not on a codec's layout (a cache for pruned keys is built when the method asks: pruned_key_cache)."""
        raise RuntimeError("prune_key_channels needs a full-precision cache or one built for pruned keys; this one "
                           "stores blocks through a codec")

    @torch.no_grad()
    def keep_tokens(self, layer: int, slot: int, keep: torch.Tensor) -> None:
        """Token-level eviction: keep only slots `keep` [H, n] (sorted ascending per head; -1 pads a shorter
        head) of one sequence's layer, compacted to the front.

        A new block whose tokens are exactly one old block's tokens reuses that block as it is (packed or not);
        the rest are stored again: packed where `codec.packed_block_range` says, else in full precision.
        """
        self._check_live(slot)
        self._restored.add(slot)  # pack_pending checks this sequence on the device
        bs, D, H = self.block_size, self.head_dim, self.num_kv_heads
        keep = keep.to(self.device)
        old_len = self.lengths[slot, layer].clone()  # [H]
        table = self.tables[slot, layer]  # [H, MB] view
        pos_row = self.positions[slot, layer]  # [H, MB*bs] view
        dense = None
        freed: list[int] = []
        plans = []  # per head: (kept slots, reused {col: id}, fp cols, packed cols)
        for h in range(H):
            kh = keep[h][keep[h] >= 0].to(torch.int64)
            n_new = kh.numel()
            if n_new > int(old_len[h]) or (n_new and int(kh.max()) >= int(old_len[h])):
                raise ValueError(f"keep_tokens: slots out of range for a {int(old_len[h])}-token table")
            n_full = n_new // bs
            reused: dict[int, int] = {}
            if n_full:
                chunks = kh[: n_full * bs].view(n_full, bs)
                aligned = (chunks[:, 0] % bs == 0) & (chunks == chunks[:, :1] + torch.arange(bs, device=self.device)).all(1)
                for c in torch.nonzero(aligned).squeeze(1).tolist():
                    reused[c] = int(table[h, int(chunks[c, 0]) // bs])
            old_nb = blocks_for_tokens(int(old_len[h]), bs)
            reused_ids = set(reused.values())
            freed.extend(int(b) for b in table[h, :old_nb].tolist() if int(b) not in reused_ids)
            packed_range = self.codec.packed_block_range(n_new, bs)
            new_cols = [c for c in range(blocks_for_tokens(n_new, bs)) if c not in reused]
            pk_cols = [c for c in new_cols if c in packed_range]
            fp_cols = [c for c in new_cols if c not in packed_range]
            if new_cols and dense is None:
                dense = self.gather(layer, slot)  # decoded K, V [H, T, D] before anything changes
            plans.append((kh, reused, fp_cols, pk_cols))
        new_pos = [pos_row[h].gather(0, plans[h][0]).clone() for h in range(H)]
        self._check_room(sum(len(p[2]) for p in plans), sum(len(p[3]) for p in plans), freed)
        self.pool.free(freed)
        for h, (kh, reused, fp_cols, pk_cols) in enumerate(plans):
            n_new = kh.numel()
            for c, b in reused.items():
                table[h, c] = b
            if fp_cols:
                ids = self.pool.allocate(len(fp_cols), self._layer_tags([layer] * len(fp_cols)))
                for c, b in zip(fp_cols, ids):
                    sl = kh[c * bs: (c + 1) * bs]
                    self.k_pool[b].zero_()
                    self.k_pool[b, : sl.numel()] = dense[0][h, sl].to(self.fp_dtype)
                    if not self.latent:  # a latent cache's values are inside the rows just written
                        self.v_pool[b].zero_()
                        self.v_pool[b, : sl.numel()] = dense[1][h, sl].to(self.fp_dtype)
                    table[h, c] = b
            if pk_cols:
                sl = torch.stack([kh[c * bs: (c + 1) * bs] for c in pk_cols])  # [n, bs] (full blocks)
                kt, vt = dense[0][h][sl].float(), dense[1][h][sl].float()
                k_rows = self.codec.encode_keys(kt, layer, h)
                v_rows = self._encode_values(vt, layer, h)
                ids = self._allocate_packed(len(pk_cols), self._layer_tags([layer] * len(pk_cols)))
                pid = torch.tensor(ids, dtype=torch.int64, device=self.device) - self.num_fp_blocks
                self.kq_pool[pid] = k_rows
                self.vq_pool[pid] = v_rows
                for c, b in zip(pk_cols, ids):
                    table[h, c] = b
            pos_row[h, :n_new] = new_pos[h].to(pos_row.dtype)
            pos_row[h, n_new:] = -1
            self.lengths[slot, layer, h] = n_new
            self.host_lengths[slot, layer, h] = n_new
        if self.summarizes(layer):  # blocks re-stored (decoded, then packed or kept): their min / max again
            self._summarize_table(layer, slot)
