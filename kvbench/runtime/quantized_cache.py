"""A paged KV cache whose old blocks hold a storage codec's packed bytes (KIVI, KVQuant, int8, fp8).

Two pools share one block-id space, so block tables, positions, lengths, forks and eviction work as in
`PagedKVCache`:

    fp pool      k_pool, v_pool [num_blocks, block_size, head_dim] in the codec's full-precision dtype
                 (fp16 for KIVI / KVQuant, as in the papers; the model dtype otherwise)
                 ids 0 .. num_blocks-1 (0 is the scratch block)
    packed pool  kq_pool [num_packed, key_nbytes], vq_pool [num_packed, value_nbytes] uint8: one row per
                 (sequence, layer, kv-head) block of block_size tokens, laid out by the codec (codes, scales,
                 zero points, outliers, padding: every byte a block needs is in its row)
                 ids num_blocks + (0 .. num_packed-1)

A table entry below `num_blocks` is a full-precision block, any other a packed one. New tokens are always
written to full-precision blocks. At the start of every step (`prepare_append`, i.e. after the previous step's
attention and eviction hooks ran) each full block that the codec's `packed_block_range` says should be packed
(KIVI: older than the newest `residual` tokens; KVQuant: every full block but the first) is encoded into a packed
row and its full-precision block goes back to the free list at once (in every live sequence, so the prompts of
a batch are packed while the next one is prefilled). So a prefill chunk attends to its own tokens
in full precision (as KIVI's prefill does), and each decode step sees the newest residual..residual+block-1
tokens in full precision and everything older dequantized. `pack_pending()` packs without appending.
(Granularity is the block: KVQuant's "first token in fp16" keeps the whole first block, 32 tokens, in fp16.)

Reading: `attend` first offers the layer to the engine's backend (`backend.attend_packed`), which reads both pools
in place where it has a kernel for the codec (the codec lists it in `codec.kernels`): the CPU backend's C codec
kernels decode each block into an L1-sized tile as they reach it, for decode steps and for causal prefill chunks
(tests/test_codec_decode_kernel.py, tests/test_codec_prefill_kernel.py), unless the method asks for per-key
attention mass in prefill (H2O-style) or the keys are stored before RoPE (KVQuant). Otherwise the layer's blocks
are dequantized into a dense scratch buffer (the codec's own decode, or the Triton dequantizer on CUDA for a codec
that lists "triton_dequant") and `backend.attend` runs on it, unchanged (pre-RoPE keys, as KVQuant stores them, are
rotated by the model's `rotate_keys` after dequantization).

Bytes: `kv_bytes_in_use` = full-precision blocks in use x their bytes + packed blocks in use x their row bytes,
all counted from the pools; `peak_kv_bytes` is the largest such sum seen (updated at every allocation).

Block size: a codec may need a block of at least its group (KIVI keys per channel: block_size % G == 0); the cache
uses lcm(requested block_size, codec.block_size_hint) tokens per block and keeps the same token capacity. Both
sizes are in `describe_storage()`.

Eviction composes:
- `evict_blocks` (block level) moves no data: packed and full-precision blocks are dropped alike, freed at once.
- `keep_tokens` (token level) keeps every block whose tokens all stay and land block-aligned as it is, packed or
  not (a prefix of untouched blocks, or whole blocks dropped); the other kept tokens are compacted and stored again
  (packed where the codec's rule says). Restriction: kept tokens that were already packed and must move inside a
  block are decoded and encoded again (a second rounding), so per-step token-level eviction over an old packed
  region (H2O style) costs re-encoding and some accuracy; prefill-time selection over the newest chunk moves
  full-precision data only.
- fork (and the prefix cache) shares packed and full-precision blocks alike; a shared full-precision block is packed
  once and the packed block stays shared by every table that held it.
"""
from __future__ import annotations

import numpy as np
import torch

from kvbench.runtime.backends import triton as triton_backend
from kvbench.runtime.block_pool import BlockPool, OutOfBlocksError
from kvbench.runtime.kv_cache import SCRATCH_BLOCK, AppendPlan, PagedKVCache
from kvbench.runtime.kv_geometry import block_bytes, kv_elements


class RoutedBlockPool:
    """Two BlockPools in one id space: ids < fp.num_blocks are full-precision blocks, the rest packed.

    Quacks like `BlockPool` for the cache code: `allocate` hands out full-precision blocks, `free` / `share` /
    `refcount` route by id. Tracks the peak of bytes in use (both pools together) at every allocation.
    """

    def __init__(self, num_fp: int, num_packed: int, fp_block_bytes: int, packed_block_bytes: int,
                 max_bytes: int | None = None):
        self.max_bytes = max_bytes if max_bytes is not None else (
            (num_fp - 1) * fp_block_bytes + num_packed * packed_block_bytes)
        self.fp = BlockPool(num_fp, reserved=1)
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


class QuantizedPagedKVCache(PagedKVCache):
    """PagedKVCache whose blocks are packed by a storage codec once they leave the full-precision window."""

    plain_pools = False  # packed rows have the codec's layout: drop_slots falls back to keep_tokens

    def __init__(self, *, codec, block_size: int, max_bytes: int, dequant: str = "auto", **kwargs):
        """block_size must already suit the codec (see `codec_block_size`); max_bytes bounds the bytes of both
        pools together (the engine's kv_memory_bytes)."""
        if dequant not in ("auto", "torch", "triton"):
            raise ValueError(f"dequant must be auto, torch or triton, got {dequant!r}")
        if block_size % int(getattr(codec, "block_size_hint", 1) or 1):
            raise ValueError(f"block_size {block_size} is not a multiple of the codec's {codec.block_size_hint}")
        self.codec = codec
        self.max_bytes = int(max_bytes)
        if kwargs.get("store_pre_rope") is None:
            kwargs["store_pre_rope"] = bool(getattr(codec, "pre_rope_keys", False))
        super().__init__(block_size=block_size, num_blocks=0, **kwargs)
        self.dequant = self._pick_dequant(dequant)
        # slot -> (host lengths [L, H], tokens_seen) when pack_pending last looked at it (see _may_need_packing)
        self._pack_seen: dict[int, tuple[np.ndarray, int]] = {}
        self._restored: set[int] = set()  # slots whose tokens keep_tokens stored again since (checked on device)

    def _make_storage(self, num_blocks: int) -> None:
        """Full-precision pool (the codec's fp dtype) and packed pool, each large enough to take all of
        max_bytes on its own (virtual until written); the router enforces max_bytes over both."""
        bs, D = self.block_size, self.head_dim
        self.fp_dtype = getattr(self.codec, "fp_block_dtype", None) or self.dtype
        fp_block_bytes = block_bytes(bs, D, self.fp_dtype)
        self.key_nbytes = self.codec.packed_block_bytes(bs, D, "key")
        self.value_nbytes = self.codec.packed_block_bytes(bs, D, "value")
        packed_block_bytes = self.key_nbytes + self.value_nbytes
        n_fp = max(2, self.max_bytes // fp_block_bytes + 1)  # + the scratch block
        n_packed = max(1, self.max_bytes // packed_block_bytes)
        self.k_pool = torch.empty(n_fp, bs, D, dtype=self.fp_dtype, device=self.device)
        self.v_pool = torch.empty(n_fp, bs, D, dtype=self.fp_dtype, device=self.device)
        self.k_pool[SCRATCH_BLOCK] = 0
        self.v_pool[SCRATCH_BLOCK] = 0
        self.kq_pool = torch.empty(n_packed, self.key_nbytes, dtype=torch.uint8, device=self.device)
        self.vq_pool = torch.empty(n_packed, self.value_nbytes, dtype=torch.uint8, device=self.device)
        self.num_fp_blocks = n_fp
        self.pool = RoutedBlockPool(n_fp, n_packed, fp_block_bytes, packed_block_bytes, self.max_bytes)

    def free_blocks(self) -> int:
        return self.pool.free_fp_blocks()

    def capacity_blocks(self) -> int:
        return self.max_bytes // self.pool.fp_block_bytes

    def pool_bytes(self) -> int:
        return self.max_bytes

    def blocks_in_use_now(self) -> int:
        return -(-self.pool.bytes_in_use() // self.pool.fp_block_bytes)

    def _pick_dequant(self, dequant: str) -> str:
        """auto: the Triton dequantizer on CUDA for a codec it reads (codec.kernels), when triton is installed."""
        readable = "triton_dequant" in getattr(self.codec, "kernels", ())
        if dequant == "triton":
            if not readable:
                raise ValueError("dequant=triton supports 2- and 4-bit KIVI blocks only")
            return "triton"
        if dequant == "auto" and readable and self.device.type == "cuda":
            return "triton" if triton_backend.installed() else "torch"
        return "torch"

    # ------------------------------------------------------------------ sizes and bytes
    @property
    def packed_block_bytes(self) -> int:
        """Bytes of one packed block in the pool (K row + V row, all metadata)."""
        return self.kq_pool[0].nbytes + self.vq_pool[0].nbytes

    def kv_bytes_in_use(self) -> int:
        return self.pool.bytes_in_use()

    def peak_kv_bytes(self) -> int:
        return self.pool.peak_bytes

    def fork_shared_bytes(self) -> int:
        return self.pool.shared_bytes()

    def kv_bytes_per_token(self) -> float:
        """Pool bytes one packed token costs across all layers and kv-heads (codes and all metadata): the
        long-context rate. The measured average at a given moment is `kv_bytes_in_use() / held tokens`."""
        return self.packed_block_bytes * self.num_layers * self.num_kv_heads / self.block_size

    def held_elements(self) -> int:
        """K and V elements the live tables hold (2 x tokens x head_dim over all layers and heads)."""
        return kv_elements(int(sum(int(self.lengths[s].sum()) for s in self.live)), self.head_dim)

    def bits_per_element_in_use(self) -> float:
        """8 x pool bytes in use / K and V elements held now (full-precision window and all metadata included)."""
        n = self.held_elements()
        return 8.0 * self.kv_bytes_in_use() / n if n else float("nan")

    def block_counts(self) -> dict:
        """Blocks in use per pool."""
        return {"fp": self.pool.fp.in_use, "packed": self.pool.packed.in_use}

    def describe_storage(self) -> dict:
        out = {"codec": self.codec.name}
        for k, v in self.codec.describe().items():
            if k != "codec":
                out[f"codec_{k}"] = v
        bs, D = self.block_size, self.head_dim
        out.update(
            kv_dtype=_dtype_name(self.dtype), fp_block_dtype=_dtype_name(self.fp_dtype), block_size=bs,
            packed_key_bytes_per_block=self.key_nbytes,
            packed_value_bytes_per_block=self.value_nbytes,
            packed_bits_per_element=round(8.0 * self.packed_block_bytes / kv_elements(bs, D), 4),
            pre_rope_keys=self.store_pre_rope, dequant=self.dequant,
        )
        return out

    # ------------------------------------------------------------------ appending
    def prepare_append(self, slots: list[int], query_positions: torch.Tensor) -> AppendPlan:
        """Pack the blocks that left the full-precision window (of every live sequence: those outside this step
        finished theirs), then allocate room as PagedKVCache does."""
        self.pack_pending()
        return super().prepare_append(slots, query_positions)  # new tokens land in full-precision blocks

    def prepare_appends(self, groups: list[tuple[list[int], torch.Tensor]]) -> list[AppendPlan]:
        """Pack once (what left the window before this step), then allocate every group's room: a block that one
        group's append pushes out of the window stays in full precision for this step's attention, as it would
        if each sequence ran its own step."""
        self.pack_pending()
        return [PagedKVCache.prepare_append(self, slots, qpos) for slots, qpos in groups]

    def write(self, layer: int, plan: AppendPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer (in the full-precision pool). k, v: [S, H, Q, D]."""
        rows = plan.write_index[:, layer].reshape(-1)
        D = self.head_dim
        self.k_pool.view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.fp_dtype))
        self.v_pool.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.fp_dtype))

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
            v_rows = self.codec.encode_values(self.v_pool[fp_ids].float())
        else:  # per-layer levels / ranges (KVQuant)
            k_rows = torch.empty(fp_ids.numel(), self.key_nbytes, dtype=torch.uint8, device=self.device)
            v_rows = torch.empty(fp_ids.numel(), self.value_nbytes, dtype=torch.uint8, device=self.device)
            for layer in torch.unique(l_u).tolist():
                sel = torch.nonzero(l_u == layer).squeeze(1)
                ids, heads = fp_ids[sel], h_u[sel]
                k_rows[sel] = self.codec.encode_keys(self.k_pool[ids].float(), layer, heads)
                v_rows[sel] = self.codec.encode_values(self.v_pool[ids].float(), layer, heads)
        new_ids = torch.tensor(self._allocate_packed_for(fp_ids, all_ids.tolist()), dtype=torch.int64,
                               device=self.device)
        extra = torch.bincount(inverse, minlength=fp_ids.numel()) - 1  # more tables holding the same block
        if bool((extra > 0).any()):
            self.pool.share(torch.repeat_interleave(new_ids, extra).tolist())
        pid = new_ids - self.num_fp_blocks
        self.kq_pool[pid] = k_rows
        self.vq_pool[pid] = v_rows
        self.tables[st[s_i], l_i, h_i, c_i] = new_ids[inverse].to(torch.int32)
        return int(fp_ids.numel())

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

    def free_sequence(self, slot: int) -> None:
        self._pack_seen.pop(slot, None)
        self._restored.discard(slot)
        super().free_sequence(slot)

    def _allocate_packed_for(self, fp_ids: torch.Tensor, table_refs: list[int]) -> list[int]:
        """Packed blocks for the distinct full-precision blocks fp_ids: every table reference to them is dropped
        first (freeing them, so packing never raises the bytes in use), then the packed blocks are allocated and
        block listeners (the prefix cache) follow the tokens from the old ids to the new ones."""
        old = fp_ids.tolist()
        listeners, self.pool.release_listeners = self.pool.release_listeners, []  # not forgotten: moved
        try:
            self.pool.free(table_refs)
        finally:
            self.pool.release_listeners = listeners
        new = self._allocate_packed(len(old))
        for listener in self.block_listeners:
            listener.replace(old, new)
        return new

    def _allocate_packed(self, n: int) -> list[int]:
        return self.pool.allocate_packed(n)

    def _check_room(self, n_fp: int, n_packed: int, freed: list[int]) -> None:
        """Raise OutOfBlocksError before anything changes unless n_fp / n_packed blocks can be allocated once
        `freed` (ids about to be released) are back."""
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
        net = ((n_fp - back_fp) * pool.fp_block_bytes + (n_packed - back_pk) * pool.packed_block_bytes)
        if pool.bytes_in_use() + net > pool.max_bytes:
            raise OutOfBlocksError(n_fp + n_packed, pool.free_fp_blocks(), pool.max_bytes // pool.fp_block_bytes)

    # ------------------------------------------------------------------ block bytes (swap space)
    def _split_ids(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return t[t < self.num_fp_blocks], t[t >= self.num_fp_blocks] - self.num_fp_blocks

    def block_payload(self, ids: list[int]) -> list[torch.Tensor]:
        """Full-precision blocks' K, V and packed blocks' K, V rows (in `ids` order within each kind)."""
        fp, pk = self._split_ids(ids)
        return [self.k_pool[fp], self.v_pool[fp], self.kq_pool[pk], self.vq_pool[pk]]

    def block_payload_bytes(self, ids: list[int]) -> int:
        n_fp = sum(1 for b in ids if b < self.num_fp_blocks)
        return n_fp * self.pool.fp_block_bytes + (len(ids) - n_fp) * self.pool.packed_block_bytes

    def allocate_like(self, ids: list[int]) -> list[int]:
        """A full-precision block for each full-precision id, a packed one for each packed id (same order)."""
        n_fp = sum(1 for b in ids if b < self.num_fp_blocks)
        self._check_room(n_fp, len(ids) - n_fp, [])
        fp_new, pk_new = self.pool.allocate(n_fp), self._allocate_packed(len(ids) - n_fp)
        it_fp, it_pk = iter(fp_new), iter(pk_new)
        return [next(it_fp) if b < self.num_fp_blocks else next(it_pk) for b in ids]

    def write_block_payload(self, ids: list[int], payload: list[torch.Tensor]) -> None:
        fp, pk = self._split_ids(ids)
        self.k_pool[fp], self.v_pool[fp] = payload[0], payload[1]
        self.kq_pool[pk], self.vq_pool[pk] = payload[2], payload[3]

    # ------------------------------------------------------------------ rollback
    def truncate(self, slot: int, num_tokens: int) -> int:
        """PagedKVCache.truncate; a packed block that keeps only part of its tokens is stored again through
        keep_tokens (decoded, then packed or kept in full precision by the codec's rule)."""
        self._check_live(slot)
        bs = self.block_size
        pos = self.positions[slot]  # [L, H, MB*bs]
        valid = torch.arange(pos.shape[-1], device=self.device) < self.lengths[slot].unsqueeze(-1)
        new_len = (valid & (pos < num_tokens)).sum(-1)  # [L, H]
        partial = (new_len % bs != 0) & (new_len < self.lengths[slot])
        tail = self.tables[slot].gather(-1, (new_len // bs).clamp(max=self.tables.shape[-1] - 1).unsqueeze(-1))
        if not bool((partial & (tail.squeeze(-1) >= self.num_fp_blocks)).any()):
            return super().truncate(slot, num_tokens)
        before = self.pool.in_use
        for layer in range(self.num_layers):
            n = new_len[layer]  # [H]
            keep = torch.arange(int(n.max()), device=self.device).expand(self.num_kv_heads, -1).clone()
            keep[keep >= n.unsqueeze(-1)] = -1
            self.keep_tokens(layer, slot, keep)
        self.tokens_seen[slot] = min(self.tokens_seen[slot], num_tokens)
        return max(0, before - self.pool.in_use)

    def append_horizon(self, slot: int) -> int:
        """Tokens until the codec's rule packs the next block of `slot`: blocks are packed at the start of a step
        (pack_pending), so a step of up to this many tokens reads what one-token steps would."""
        R, bs = int(self.codec.residual), self.block_size
        n = self.lengths[slot]  # [L, H]
        stop = (n - R).clamp(min=0) // bs
        return max(1, int((R + (stop + 1) * bs - n).min()))

    # ------------------------------------------------------------------ reading
    def _dense_blocks(self, layer: int, tables: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The first nb blocks of each table, decoded: (k, v [S*H*nb, bs, D] in the model dtype, nb).

        tables [S, H, MB], lengths [S, H]; row (s*H + h)*nb + c is block c of table (s, h). Columns past a
        table's own length are zeros.
        """
        S, H = tables.shape[:2]
        bs, D = self.block_size, self.head_dim
        T = int(lengths.max()) if lengths.numel() else 0
        nb = max(1, -(-T // bs))
        ids = tables[:, :, :nb].reshape(-1).to(torch.int64)  # [S*H*nb]
        own = ((lengths + bs - 1) // bs).reshape(-1, 1)  # [S*H, 1]
        valid = (torch.arange(nb, device=self.device) < own).reshape(-1)
        k = torch.zeros(S * H * nb, bs, D, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        fp_pos = torch.nonzero(valid & (ids < self.num_fp_blocks)).squeeze(1)
        if fp_pos.numel():
            fid = ids[fp_pos]
            k.index_copy_(0, fp_pos, self.k_pool.index_select(0, fid).to(self.dtype))
            v.index_copy_(0, fp_pos, self.v_pool.index_select(0, fid).to(self.dtype))
        pk_pos = torch.nonzero(valid & (ids >= self.num_fp_blocks)).squeeze(1)
        if pk_pos.numel():
            pid = ids[pk_pos] - self.num_fp_blocks
            heads = (pk_pos // nb) % H
            k.index_copy_(0, pk_pos, self._decode("key", self.kq_pool.index_select(0, pid), layer, heads))
            v.index_copy_(0, pk_pos, self._decode("value", self.vq_pool.index_select(0, pid), layer, heads))
        return k, v, nb

    def _dense_table_blocks(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Every block of the tables' width MB, decoded, with no host sync (no shape depends on values): (k, v
        [S*H*MB, bs, D] in the model dtype, MB). Full-precision entries are read from the fp pool; the packed rows
        are decoded for every entry (a full-precision entry decodes a zero row, discarded)."""
        S, H, MB = tables.shape
        ids = tables.reshape(-1).to(torch.int64)  # [S*H*MB]
        packed = ids >= self.num_fp_blocks
        fid = torch.where(packed, 0, ids)
        pid = torch.where(packed, ids - self.num_fp_blocks, 0)
        heads = (torch.arange(ids.numel(), device=self.device) // MB) % H
        zero = torch.zeros((), dtype=torch.uint8, device=self.device)
        out = []
        for kind, fp_pool, q_pool in (("key", self.k_pool, self.kq_pool), ("value", self.v_pool, self.vq_pool)):
            rows = torch.where(packed[:, None], q_pool.index_select(0, pid), zero)
            dec = self._decode(kind, rows, layer, heads)
            out.append(torch.where(packed[:, None, None], dec, fp_pool.index_select(0, fid).to(self.dtype)))
        return out[0], out[1], MB

    def _decode(self, kind: str, rows: torch.Tensor, layer: int, heads: torch.Tensor) -> torch.Tensor:
        bs, D = self.block_size, self.head_dim
        if self.dequant == "triton":
            dequantize_rows = triton_backend.load("dequant").dequantize_rows
            return dequantize_rows(self.codec, rows.contiguous(), kind, bs, D).to(self.dtype)
        if kind == "key":
            return self.codec.decode_keys(rows, bs, D, layer, heads, dtype=self.dtype)
        return self.codec.decode_values(rows, bs, D, layer, heads, dtype=self.dtype)

    def attend(self, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, *, backend,
               return_key_scores: bool = False, rotate_keys=None, causal: bool = True):
        """Attention over this layer's blocks: read in place by the backend where it can (`attend_packed`), else
        dequantized and attended by `backend.attend`, as PagedKVCache.attend does."""
        res = backend.attend_packed(self, layer, q, plan, scale, return_key_scores=return_key_scores,
                                    rotate_keys=rotate_keys, causal=causal)
        if res is not None:
            return res
        tables, lengths = plan.tables[:, layer], plan.lengths[:, layer]
        S, H = tables.shape[:2]
        if q.shape[2] == 1 and not causal:  # decode: every block of the tables' width, no host sync
            k, v, nb = self._dense_table_blocks(layer, tables)
        else:
            k, v, nb = self._dense_blocks(layer, tables, lengths)
        dense_tables = torch.arange(S * H * nb, dtype=torch.int32, device=self.device).view(S, H, nb)
        return backend.attend(
            q, k, v, dense_tables, lengths, plan.positions[:, layer, :, : nb * self.block_size],
            plan.query_positions, scale,
            return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal,
        )

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense (dequantized) K, V [H, T, D] and positions [H, T] of one sequence's layer (pad = -1)."""
        self._check_live(slot)
        lengths = self.lengths[slot, layer]
        T = int(self.host_lengths[slot, layer].max())  # from the host copy: no device read
        H, D = self.num_kv_heads, self.head_dim
        nb = max(1, -(-T // self.block_size))
        k, v, _ = self._dense_table_blocks(layer, self.tables[slot, layer, :, :nb][None])
        k = k.view(H, nb * self.block_size, D)[:, :T]
        v = v.view(H, nb * self.block_size, D)[:, :T]
        pad = torch.arange(T, device=self.device)[None, :] >= lengths[:, None]
        pos = torch.where(pad, -1, self.positions[slot, layer, :, :T])
        return k, v, pos

    # ------------------------------------------------------------------ eviction
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
            old_nb = -(-int(old_len[h]) // bs)
            reused_ids = set(reused.values())
            freed.extend(int(b) for b in table[h, :old_nb].tolist() if int(b) not in reused_ids)
            packed_range = self.codec.packed_block_range(n_new, bs)
            new_cols = [c for c in range(-(-n_new // bs)) if c not in reused]
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
                ids = self.pool.allocate(len(fp_cols))
                for c, b in zip(fp_cols, ids):
                    sl = kh[c * bs: (c + 1) * bs]
                    self.k_pool[b].zero_()
                    self.v_pool[b].zero_()
                    self.k_pool[b, : sl.numel()] = dense[0][h, sl].to(self.fp_dtype)
                    self.v_pool[b, : sl.numel()] = dense[1][h, sl].to(self.fp_dtype)
                    table[h, c] = b
            if pk_cols:
                sl = torch.stack([kh[c * bs: (c + 1) * bs] for c in pk_cols])  # [n, bs] (full blocks)
                kt, vt = dense[0][h][sl].float(), dense[1][h][sl].float()
                k_rows = self.codec.encode_keys(kt, layer, h)
                v_rows = self.codec.encode_values(vt, layer, h)
                ids = self._allocate_packed(len(pk_cols))
                pid = torch.tensor(ids, dtype=torch.int64, device=self.device) - self.num_fp_blocks
                self.kq_pool[pid] = k_rows
                self.vq_pool[pid] = v_rows
                for c, b in zip(pk_cols, ids):
                    table[h, c] = b
            pos_row[h, :n_new] = new_pos[h].to(pos_row.dtype)
            pos_row[h, n_new:] = -1
            self.lengths[slot, layer, h] = n_new
            self.host_lengths[slot, layer, h] = n_new


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
