"""Byte and block accounting of a paged cache, read from its block pool: bytes in use, peak, per token, shared by
forks, the pool's size, and the blocks an append needs (what the scheduler admits and preempts by).

`KVAccounting` is mixed into `PagedKVCache` (kvbench.runtime.cache.kv_cache); a storage codec's cache
(kvbench.runtime.cache.quantized_cache) overrides the byte figures with its two pools'. Sizes are kv_geometry's.
"""
from __future__ import annotations

from kvbench.runtime.cache.kv_geometry import block_bytes, blocks_for_tokens, token_bytes


class KVAccounting:
    """What a PagedKVCache's pool holds and can hold, in bytes and blocks (its pool, tables and lengths are the
    cache's)."""

    # ------------------------------------------------------------------ bytes
    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies in the pool (K and V, a latent cache's one row per token, and its key summary
        when the cache keeps them)."""
        summaries = getattr(self, "summaries", None)
        extra = summaries.bytes_per_block if summaries is not None else 0
        return self.kv_block_bytes + extra

    @property
    def kv_block_bytes(self) -> int:
        """K and V bytes of one block (what attention reads of it)."""
        return block_bytes(self.block_size, self.head_dim, self.k_pool.dtype, getattr(self, "latent", False))

    def uncompressed_block_bytes(self) -> int:
        """Bytes one block takes uncompressed, in the model dtype (what full_kv_bytes counts)."""
        return block_bytes(self.block_size, self.head_dim, self.dtype, getattr(self, "latent", False))

    @property
    def full_bytes_per_token(self) -> int:
        """Bytes an uncompressed cache needs per token (all layers, kv-heads, K and V)."""
        if getattr(self, "latent", False):
            return self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def decode_read_bytes(self, plan, layers: list[int]):
        """K/V bytes a decode step's attention reads over `layers` when it reads every block of the plan's tables
        (from the host copy of the lengths: an int)."""
        held = blocks_for_tokens(plan.host_lengths_array()[:, layers], self.block_size)
        return int(held.sum()) * self.kv_block_bytes

    def sliding_layer_ids(self) -> list[int]:
        """The layers with a sliding window (layer_windows, set by the engine for such a model): a ring each."""
        return [i for i, w in enumerate(getattr(self, "layer_windows", ()) or ()) if w is not None]

    def uncompressed_read_bytes(self, slots: list[int]) -> int:
        """Bytes full attention reads per decode step over uncompressed caches of these sequences, model dtype: in
        a full layer every block of every token they appended; in a sliding layer the blocks of its ring (what full
        attention itself reads there: a sliding layer is never compressed), so a full run reads 100% of it."""
        bs = self.block_size
        sliding = self.sliding_layer_ids()
        full_layers = self.num_layers - len(sliding)
        blocks = sum(-(-self.tokens_seen[s] // bs) for s in slots) * full_layers * self.num_kv_heads
        if sliding and slots:
            blocks += int(blocks_for_tokens(self.host_lengths[slots][:, sliding], bs).sum())
        return blocks * self.uncompressed_block_bytes()  # a latent cache (MLA): one row per token

    def kv_bytes_in_use(self) -> int:
        """K/V bytes the pool holds now (blocks in use x bytes per block)."""
        return self.pool.in_use * self.bytes_per_block

    def peak_kv_bytes(self) -> int:
        """The most K/V bytes the pool held at once (since the last reset of its peak)."""
        return self.pool.peak_in_use * self.bytes_per_block

    def fork_shared_bytes(self) -> int:
        """Bytes that forked sequences share now: the live tables reference kv_bytes_in_use() + this
        (a block shared by n tables counts n times there, once in the pool); counted by the pool's refcounts."""
        return self.pool.shared_refs * self.bytes_per_block

    def pool_bytes(self) -> int:
        """The most K/V bytes the pool can hold at once."""
        return self.pool.capacity * self.bytes_per_block

    def kv_bytes_per_token(self) -> float:
        """Pool bytes one more cached token costs across the layers that grow with the context and all kv-heads
        (codecs override): every layer, or a model with sliding layers its full layers only (a sliding layer's ring
        holds a fixed size once its window is full): kvbench-info's kv_bytes_per_token for the same model."""
        layers = self.num_layers - len(self.sliding_layer_ids())
        return self.bytes_per_block * layers * self.num_kv_heads / self.block_size

    def block_payload_bytes(self, ids: list[int]) -> int:
        """Bytes of blocks `ids` in this cache's layout (what swap space moves)."""
        return len(ids) * self.bytes_per_block

    def describe_storage(self) -> dict:
        """Settings of the storage, recorded in results."""
        return {"codec": "full", "kv_dtype": str(self.dtype).replace("torch.", "")}

    # ------------------------------------------------------------------ blocks (for the scheduler)
    def free_blocks(self) -> int:
        """New blocks an append could get now."""
        return self.pool.num_free

    def capacity_blocks(self) -> int:
        """Blocks the pool can hand out in all."""
        return self.pool.capacity

    def blocks_in_use_now(self) -> int:
        """Blocks the pool holds now."""
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
