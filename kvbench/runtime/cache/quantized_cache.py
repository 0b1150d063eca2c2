"""A paged KV cache whose old blocks hold a storage codec's packed bytes (KIVI, KVQuant, int8, fp8, NVFP4, MXFP4).

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
(tests/runtime/test_codec_decode_kernel.py, tests/runtime/test_codec_prefill_kernel.py), unless the method asks
for per-key attention mass in prefill (H2O-style) or the keys are stored before RoPE (KVQuant). Otherwise the layer's blocks
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

The parts, one module each: the two pools in one id space (quantized_pool.RoutedBlockPool), packing and storing kept
tokens again (quantized_packing), dequantizing reads (quantized_reading); the cache's tables, allocation and byte
figures here, over PagedKVCache's.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvbench.runtime import huge_pages
from kvbench.runtime.backends import triton as triton_backend
from kvbench.runtime.cache.kv_cache import SCRATCH_BLOCK, AppendPlan, PagedKVCache
from kvbench.runtime.cache.kv_geometry import block_bytes, blocks_for_tokens, kv_elements
from kvbench.runtime.cache.page_retrieval import kv_head_selection, select_pages, select_pages_per_head
from kvbench.runtime.cache.quantized_packing import PackedStorage
from kvbench.runtime.cache.quantized_pool import RoutedBlockPool
from kvbench.runtime.cache.quantized_reading import PackedReading

__all__ = ["QuantizedPagedKVCache", "RoutedBlockPool"]


class QuantizedPagedKVCache(PackedStorage, PackedReading, PagedKVCache):
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
        max_bytes on its own (virtual until written; on huge pages on CPU, kvbench.runtime.huge_pages); the router enforces max_bytes over both."""
        bs, D = self.block_size, self.head_dim
        self.fp_dtype = getattr(self.codec, "fp_block_dtype", None) or self.dtype
        fp_block_bytes = block_bytes(bs, D, self.fp_dtype, self.latent)
        self.key_nbytes = self.codec.packed_block_bytes(bs, D, "key")
        # a latent cache (MLA) packs one row per token, through the key codec: its values are read inside the rows
        self.value_nbytes = 0 if self.latent else self.codec.packed_block_bytes(bs, D, "value")
        packed_block_bytes = self.key_nbytes + self.value_nbytes
        n_fp = max(2, self.max_bytes // fp_block_bytes + 1)  # + the scratch block
        n_packed = max(1, self.max_bytes // packed_block_bytes)
        self.k_pool = huge_pages.empty((n_fp, bs, D), self.fp_dtype, self.device)
        if self.latent:  # the values: the rows' first value_dim dims (no bytes of their own)
            self.v_pool = self.k_pool[..., : self.value_dim]
            self.vq_pool = torch.empty((n_packed, 0), dtype=torch.uint8, device=self.device)
        else:
            self.v_pool = huge_pages.empty((n_fp, bs, D), self.fp_dtype, self.device)
            self.vq_pool = huge_pages.empty((n_packed, self.value_nbytes), torch.uint8, self.device)
        self.k_pool[SCRATCH_BLOCK] = 0
        self.v_pool[SCRATCH_BLOCK] = 0
        self.kq_pool = huge_pages.empty((n_packed, self.key_nbytes), torch.uint8, self.device)
        self.num_fp_blocks = n_fp
        self.pool = RoutedBlockPool(n_fp, n_packed, fp_block_bytes, packed_block_bytes, self.max_bytes)
        self.kv_fp_block_bytes, self.kv_packed_block_bytes = fp_block_bytes, packed_block_bytes  # K/V only

    def _packed_pools(self) -> dict:
        """Its codec, packed pools and the dtype of its full-precision blocks, for its DecodePools view."""
        return {"codec": self.codec, "kq_pool": self.kq_pool, "vq_pool": self.vq_pool, "fp_dtype": self.fp_dtype}

    def free_blocks(self) -> int:
        return self.pool.free_fp_blocks()

    def capacity_blocks(self) -> int:
        return self.max_bytes // self.pool.fp_block_bound

    def pool_bytes(self) -> int:
        return self.max_bytes

    def blocks_in_use_now(self) -> int:
        return -(-self.pool.bytes_in_use() // self.pool.fp_block_bound)

    def _pick_dequant(self, dequant: str) -> str:
        """auto: the Triton dequantizer on CUDA for a codec it reads (codec.kernels), when triton is installed."""
        readable = "triton_dequant" in getattr(self.codec, "kernels", ())
        if dequant == "triton":
            if not readable:
                raise ValueError("dequant=triton supports 2- and 4-bit KIVI, NVFP4 and MXFP4 blocks only")
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

    def decode_read_bytes(self, plan: AppendPlan, layers: list[int]) -> torch.Tensor:
        """K/V bytes a decode step's attention reads over `layers` of the plan's tables: each held block at its
        kind's size (full-precision or packed), counted on the device (no host read)."""
        return self.selection_read_bytes(plan.tables[:, layers], plan.lengths[:, layers])

    def selection_read_bytes(self, tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """K/V bytes of the blocks of tables [..., MB] holding `lengths` [...] tokens, each at its kind's size."""
        held = blocks_for_tokens(lengths, self.block_size)
        valid = torch.arange(tables.shape[-1], device=tables.device) < held[..., None]
        fp = (valid & (tables < self.num_fp_blocks)).sum()
        return fp * self.kv_fp_block_bytes + (valid.sum() - fp) * self.kv_packed_block_bytes

    # ------------------------------------------------------------------ page retrieval (quest over a codec)
    def _count_summary_bytes(self) -> None:
        """A block of a retrieving layer, of either kind, carries a key summary: the pool counts it for those blocks
        (tagged as they are allocated) in its bytes, peak and limit."""
        self.pool.count_summaries(self.summaries.bytes_per_block)

    def _summarize_table(self, layer: int, slot: int) -> None:
        """Recompute one sequence's layer's key summaries from its keys as attention reads them (decoded)."""
        table = self.tables[slot, layer]  # [H, MB]
        H, MB = table.shape
        keys = self._dense_table_blocks(layer, table[None])[0].view(H, MB, self.block_size, self.head_dim)
        self.summaries.recompute(keys, table, self.lengths[slot, layer])

    def attend_pages(self, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, pages: int, *,
                     backend) -> tuple[torch.Tensor, torch.Tensor]:
        """PagedKVCache.attend_pages over this cache's blocks (full-precision and packed, read as `attend` reads
        them): the selected blocks' compacted tables stand in for the layer's tables (per kv-head: the union; per
        query head with page_retrieval.per_head, read as Hq tables of one query head each)."""
        select = select_pages_per_head if self.page_retrieval.per_head else select_pages
        tables, lengths = select(q[:, :, 0], self.summaries.summary, plan.tables[:, layer],
                                 plan.lengths[:, layer], self.block_size, pages)  # [S, H or Hq, U]
        S, H, U = tables.shape
        L = plan.tables.shape[1]
        view = dataclasses.replace(  # every layer's entry is the selection (views): attend reads `layer`'s
            plan, tables=tables[:, None].expand(S, L, H, U), lengths=lengths[:, None].expand(S, L, H),
            key_positions=torch.zeros(S, 1, H, U * self.block_size, dtype=torch.int32,
                                      device=tables.device).expand(S, L, H, U * self.block_size))
        out, _ = self.attend(layer, q, view, scale, backend=backend, causal=False)
        if self.page_retrieval.per_head:  # a block two query heads of a kv-head read counts once
            tables, lengths = kv_head_selection(tables, lengths, self.num_kv_heads, self.block_size)
        return out, self.selection_read_bytes(tables, lengths)

    def peak_kv_bytes(self) -> int:
        return self.pool.peak_bytes

    def fork_shared_bytes(self) -> int:
        return self.pool.shared_bytes()

    def kv_bytes_per_token(self) -> float:
        """Pool bytes one packed token costs across the layers that grow with the context (all, or the full
        layers of a model with sliding ones) and all kv-heads (codes and all metadata, and the key summary of a
        retrieving layer's blocks): the long-context rate. The measured average at a given moment is
        `kv_bytes_in_use() / held tokens`."""
        growing = self.growing_layer_ids()
        summaries = int(self.summary_layers[growing].sum()) * self.summary_block_bytes
        return (self.packed_block_bytes * len(growing) + summaries) * self.num_kv_heads / self.block_size

    def held_elements(self) -> int:
        """K and V elements the live tables hold (2 x tokens x head_dim over all layers and heads; a latent cache:
        its rows, tokens x head_dim)."""
        tokens = int(sum(int(self.lengths[s].sum()) for s in self.live))
        return tokens * self.head_dim if self.latent else kv_elements(tokens, self.head_dim)

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
            packed_bits_per_element=round(8.0 * self.packed_block_bytes / (bs * D if self.latent else
                                                                           kv_elements(bs, D)), 4),
            latent_rows=self.latent,
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
        if not self.latent:  # a latent cache's values are inside its rows
            self.v_pool.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.fp_dtype))
        if self.summarizes(layer):  # the blocks' min / max keys, from the keys as stored
            self.summaries.update(rows, self.k_pool.view(-1, D)[rows])

    def free_sequence(self, slot: int) -> None:
        self._pack_seen.pop(slot, None)
        self._restored.discard(slot)
        super().free_sequence(slot)

    # ------------------------------------------------------------------ block bytes (swap space)
    def _split_ids(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return t[t < self.num_fp_blocks], t[t >= self.num_fp_blocks] - self.num_fp_blocks

    def block_payload(self, ids: list[int]) -> list[torch.Tensor]:
        """Full-precision blocks' K, V and packed blocks' K, V rows (in `ids` order within each kind)."""
        fp, pk = self._split_ids(ids)
        payload = [self.k_pool[fp], self.v_pool[fp], self.kq_pool[pk], self.vq_pool[pk]]
        if self.summaries is not None:  # page retrieval: the key summaries of the blocks that carry one (ids order)
            payload.append(self.summaries.summary[self._tagged_ids(ids)])
        return payload

    def block_payload_bytes(self, ids: list[int]) -> int:
        n_fp = sum(1 for b in ids if b < self.num_fp_blocks)
        tagged = sum(self.pool.tags_of(ids)) if self.summaries is not None else 0
        return (n_fp * self.pool.fp_block_bytes + (len(ids) - n_fp) * self.pool.packed_block_bytes
                + tagged * self.pool.summary_bytes)

    def allocate_like(self, ids: list[int], tags: list[int] | None = None) -> list[int]:
        """A full-precision block for each full-precision id, a packed one for each packed id (same order; `tags`:
        whether each carries a key summary, as the pool's tags_of said while they were held)."""
        is_fp = [b < self.num_fp_blocks for b in ids]
        n_fp = sum(is_fp)
        self._check_room(n_fp, len(ids) - n_fp, [])
        fp_tags = pk_tags = None
        if tags is not None:
            fp_tags = [t for t, f in zip(tags, is_fp) if f]
            pk_tags = [t for t, f in zip(tags, is_fp) if not f]
        fp_new, pk_new = self.pool.allocate(n_fp, fp_tags), self._allocate_packed(len(ids) - n_fp, pk_tags)
        it_fp, it_pk = iter(fp_new), iter(pk_new)
        return [next(it_fp) if f else next(it_pk) for f in is_fp]

    def write_block_payload(self, ids: list[int], payload: list[torch.Tensor]) -> None:
        fp, pk = self._split_ids(ids)
        self.k_pool[fp], self.v_pool[fp] = payload[0], payload[1]
        self.kq_pool[pk], self.vq_pool[pk] = payload[2], payload[3]
        if self.summaries is not None:
            self.summaries.summary[self._tagged_ids(ids)] = payload[4]

    # ------------------------------------------------------------------ rollback
    def truncate(self, slot: int, num_tokens: int) -> int:
        """PagedKVCache.truncate; a packed block that keeps only part of its tokens is stored again through
        keep_tokens (decoded, then packed or kept in full precision by the codec's rule)."""
        self._check_live(slot)
        bs = self.block_size
        pos = self.positions[slot]  # [L, H, MB*bs]
        valid = torch.arange(pos.shape[-1], device=self.device) < self.lengths[slot].unsqueeze(-1)
        new_len = (valid & (pos < num_tokens - self.position_shift[slot])).sum(-1)  # [L, H]
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
