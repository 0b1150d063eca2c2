"""How a full-precision paged cache stores its bytes: the K/V pools and the operations that depend on their layout.

    k_pool, v_pool: [num_blocks, block_size, head_dim] in the cache dtype (block SCRATCH_BLOCK: zeros, never handed out)

A latent cache (value_dim set: MLA) stores one row per token, [latent ; rope key] of head_dim, in k_pool; v_pool is
the view k_pool[..., :value_dim] (the latent, which MLA's absorbed attention reads as its values): no bytes of its
own, never written apart.

`FullPrecisionLayout` is mixed into `PagedKVCache` (kvbench.runtime.cache.kv_cache); a storage codec's cache
(kvbench.runtime.cache.quantized_cache) overrides the members that touch the bytes with its own packed layout: the pool
and the bytes (`_make_storage`), writing a step's K/V, attention over a layer, the dense K/V of a sequence, how far
one step may append, and the bytes of blocks in the cache's layout (what swap space copies to host memory and
back). `layer_tables`, which reads a layer's tables only (for kernels), is the same for both.
"""
from __future__ import annotations

import torch

from kvbench.runtime import huge_pages
from kvbench.runtime.cache.append_plan import AppendPlan
from kvbench.runtime.cache.block_pool import BlockPool
from kvbench.runtime.cache.kv_geometry import SCRATCH_BLOCK, SCRATCH_BLOCKS, blocks_for_tokens
from kvbench.runtime.cache.page_retrieval import kv_head_selection, select_pages, select_pages_per_head


class FullPrecisionLayout:
    """The full-precision block layout of a PagedKVCache (its tables, lengths and positions are the cache's)."""

    # Every block of every table is a [block_size, head_dim] row block of k_pool / v_pool in the cache dtype, written
    # by `write` and read by `attend` as here: kernels (the Triton attention, the fused CPU decode step) and
    # drop_slots may read, write and move those rows directly. A codec's cache, with its own block layout, sets False.
    plain_pools = True

    def _make_storage(self, num_blocks: int) -> None:
        """The block pool and the bytes: allocated once; pages are touched only as blocks are written.
        (A codec's cache overrides this with its own layout.)"""
        self.pool = BlockPool(num_blocks, reserved=SCRATCH_BLOCKS)
        shape = (num_blocks, self.block_size, self.head_dim)
        self.k_pool = huge_pages.empty(shape, self.dtype, self.device)  # on CPU: huge pages (fewer TLB misses)
        if self.latent:  # MLA: the values are the latent, the first value_dim dims of each key row
            self.v_pool = self.k_pool[..., : self.value_dim]
        else:
            self.v_pool = huge_pages.empty(shape, self.dtype, self.device)
        self.k_pool[SCRATCH_BLOCK] = 0
        self.v_pool[SCRATCH_BLOCK] = 0
        self.pool.set_block_bytes(self.kv_block_bytes)  # K/V (a retrieval method's summaries: enable_page_retrieval)

    # ------------------------------------------------------------------ writing and reading
    def write(self, layer: int, plan: AppendPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of one layer. k, v: [S, H, Q, D]."""
        rows = plan.write_index[:, layer].reshape(-1)
        D = self.head_dim
        self.k_pool.view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.dtype, copy=False))
        if not self.latent:  # a latent cache's values are inside its keys
            self.v_pool.view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.dtype, copy=False))
        if self.summarizes(layer):  # the blocks' min / max keys, from the keys as stored
            self.summaries.update(rows, self.k_pool.view(-1, D)[rows])

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

    def latent_rows(self, layer: int, plan: AppendPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [N, bs, D], tables [S, H, MB]): the pool and this layer's tables, whose blocks are the cached rows
        (MLA's expanded form reads them in place; a codec's cache returns its decoded blocks instead)."""
        return self.k_pool, plan.tables[:, layer]

    def attend_pages(self, layer: int, q: torch.Tensor, plan: AppendPlan, scale: float, pages: int, *,
                     backend) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode attention of q [S, Hq, 1, D] over only the blocks `page_retrieval.select_pages` picks (each query
        head's top `pages` blocks by their key summaries, united per kv-head; or, with `page_retrieval.per_head`, each
        query head's own, one table per query head): the kernel is given the compacted tables and reads nothing
        else. Returns (out [S, Hq, 1, D], the lengths it read [S, H])."""
        select = select_pages_per_head if self.page_retrieval.per_head else select_pages
        tables, lengths = select(q[:, :, 0], self.summaries.summary, plan.tables[:, layer], plan.lengths[:, layer],
                                 self.block_size, pages)  # [S, H or Hq, U]: per kv-head, or per query head
        # keys are cached after RoPE (a retrieval method asks so) and no mask applies (causal=False): decode
        # attention reads no key position; the argument is only shaped as the backends check it
        no_positions = torch.zeros(*tables.shape[:2], tables.shape[2] * self.block_size, dtype=torch.int32,
                                   device=tables.device)
        out, _ = backend.attend(q, self.k_pool, self.v_pool, tables, lengths, no_positions, plan.query_positions,
                                scale, causal=False)
        if self.page_retrieval.per_head:  # a block two query heads of a kv-head read counts once
            tables, lengths = kv_head_selection(tables, lengths, self.num_kv_heads, self.block_size)
        return out, self.selection_read_bytes(tables, lengths)

    def selection_read_bytes(self, tables: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """K/V bytes of the blocks of compacted tables [S, H, U] with `lengths` [S, H] (on the device)."""
        return ((lengths + self.block_size - 1) // self.block_size).sum() * self.kv_block_bytes

    def _summarize_table(self, layer: int, slot: int) -> None:
        """Recompute the key summaries of one sequence's layer from its keys (after keys moved between slots)."""
        table = self.tables[slot, layer]  # [H, MB]
        keys = self.k_pool[table.to(torch.int64)]  # [H, MB, bs, D]
        self.summaries.recompute(keys, table, self.lengths[slot, layer])

    def layer_tables(self, layer: int, slots: torch.Tensor):
        """(tables [S, H, MB] int32, lengths [S, H] int64, positions [S, H, MB*bs] int32) of one layer."""
        return self.tables[slots, layer], self.lengths[slots, layer], self.positions[slots, layer]

    def gather(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense K, V [H, T, D] and positions [H, T] of one sequence's layer (T = longest head; pad = -1)."""
        lengths = self.lengths[slot, layer]
        T = int(self.host_lengths[slot, layer].max())  # from the host copy: no device read
        nb = blocks_for_tokens(T, self.block_size)
        idx = self.tables[slot, layer, :, :nb].to(torch.int64)  # [H, nb]
        H, D = self.num_kv_heads, self.head_dim
        k = self.k_pool[idx].reshape(H, nb * self.block_size, D)[:, :T]
        v = self.v_pool[idx].reshape(H, nb * self.block_size, self.v_pool.shape[-1])[:, :T]
        pad = torch.arange(T, device=self.device)[None, :] >= lengths[:, None]
        pos = torch.where(pad, -1, self.positions[slot, layer, :, :T])
        return k, v, pos

    def append_horizon(self, slot: int) -> int:
        """How many tokens one step may append to `slot` and still compute exactly what that many one-token steps
        would (a codec's cache packs blocks between steps; full precision: no limit)."""
        return 1 << 30

    # ------------------------------------------------------------------ block bytes (swap space)
    def block_payload(self, ids: list[int]) -> list[torch.Tensor]:
        """The bytes of blocks `ids`, in this cache's layout (copies): what swap space moves to host memory (the key
        summaries of the blocks that carry one, in `ids` order)."""
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        if self.summaries is not None:
            return [self.k_pool[idx], self.v_pool[idx], self.summaries.summary[self._tagged_ids(ids)]]
        return [self.k_pool[idx], self.v_pool[idx]]

    def _tagged_ids(self, ids: list[int]) -> torch.Tensor:
        """The ids (in order) of the blocks among `ids` that carry a key summary (the pool's tags)."""
        return torch.tensor([b for b, t in zip(ids, self.pool.tags_of(ids)) if t], dtype=torch.int64,
                            device=self.device)

    def allocate_like(self, ids: list[int], tags: list[int] | None = None) -> list[int]:
        """Fresh blocks of the same kinds as `ids` (all alike here; `tags`: whether each carries a key summary, as
        the pool's tags_of said while they were held), one each; all or nothing."""
        return self.pool.allocate(len(ids), tags)

    def write_block_payload(self, ids: list[int], payload: list[torch.Tensor]) -> None:
        """Store block_payload's tensors into blocks `ids` (bit for bit; allocated by allocate_like, tags kept)."""
        idx = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.k_pool[idx] = payload[0]
        self.v_pool[idx] = payload[1]
        if self.summaries is not None:
            self.summaries.summary[self._tagged_ids(ids)] = payload[2]

