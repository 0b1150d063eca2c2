"""Byte and block accounting of a paged cache, read from its block pool: bytes in use, peak, per token, shared by
forks, the pool's size, and the blocks an append needs (what the scheduler admits and preempts by).

`KVAccounting` is mixed into `PagedKVCache` (kvbench.runtime.cache.kv_cache); a storage codec's cache
(kvbench.runtime.cache.quantized_cache) overrides the byte figures with its two pools'. Sizes are kv_geometry's.

With page retrieval, the blocks of the layers that retrieve pages also hold a key summary (block_summaries.py) and
the blocks of the other layers (dense, sliding) do not: the pool tags each block as it is allocated and measures
the bytes held and their peak per kind (block_pool.py); figures read from the tables count each layer's blocks at
that layer's size (`layer_block_bytes`).
"""
from __future__ import annotations

import numpy as np

from kvbench.runtime.cache.kv_geometry import block_bytes, blocks_for_tokens, token_bytes


class KVAccounting:
    """What a PagedKVCache's pool holds and can hold, in bytes and blocks (its pool, tables and lengths are the
    cache's)."""

    # ------------------------------------------------------------------ bytes
    @property
    def bytes_per_block(self) -> int:
        """The most bytes one block occupies in the pool: K and V (a latent cache's one row per token) and, when
        the cache keeps key summaries, a summary (held by the blocks of retrieving layers only: layer_block_bytes)."""
        return self.kv_block_bytes + self.summary_block_bytes

    @property
    def summary_block_bytes(self) -> int:
        """Bytes of one block's key summary (0 without page retrieval)."""
        summaries = getattr(self, "summaries", None)
        return summaries.bytes_per_block if summaries is not None else 0

    def layer_block_bytes(self) -> np.ndarray:
        """[L] int64: bytes one block of each layer occupies (K and V, and the key summary where the layer
        retrieves pages)."""
        return self.kv_block_bytes + self.summary_block_bytes * self.summary_layers.astype(np.int64)

    def held_bytes(self, lengths, layers: list[int] | None = None) -> int:
        """Bytes of the blocks that tables of these lengths hold (host ints [..., n, H], n = len(layers), or every
        layer), each at its layer's block size (layer_block_bytes)."""
        per_layer = self.layer_block_bytes()
        if layers is not None:
            per_layer = per_layer[layers]
        blocks = blocks_for_tokens(np.asarray(lengths), self.block_size)  # [..., n, H]
        if blocks.size == 0:
            return 0
        per_layer_blocks = blocks.sum(-1).reshape(-1, per_layer.size).sum(0)  # [n]
        return int((per_layer_blocks * per_layer).sum())

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

    def growing_layer_ids(self) -> list[int]:
        """The layers whose tables grow with the context: every layer but the sliding ones."""
        sliding = set(self.sliding_layer_ids())
        return [i for i in range(self.num_layers) if i not in sliding]

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
        """K/V bytes the pool holds now (blocks in use of each kind x that kind's bytes: the pool's count)."""
        return self.pool.bytes_in_use()

    def peak_kv_bytes(self) -> int:
        """The most K/V bytes the pool held at once (since the last reset of its peak; the pool's count)."""
        return self.pool.peak_bytes

    def fork_shared_bytes(self) -> int:
        """Bytes that forked sequences share now: the live tables reference kv_bytes_in_use() + this
        (a block shared by n tables counts n times there, once in the pool); counted by the pool's refcounts."""
        return self.pool.shared_bytes()

    def pool_bytes(self) -> int:
        """The most K/V bytes the pool can hold at once (its storage: every block with a summary slot where the cache
        keeps summaries, whichever layer holds it)."""
        return self.pool.capacity * self.bytes_per_block

    def kv_bytes_per_token(self) -> float:
        """Pool bytes one more cached token costs across the layers that grow with the context and all kv-heads
        (codecs override): every layer, or a model with sliding layers its full layers only (a sliding layer's ring
        holds a fixed size once its window is full): kvbench-info's kv_bytes_per_token for the same model. A
        retrieving layer's blocks count their key summaries too."""
        return int(self.layer_block_bytes()[self.growing_layer_ids()].sum()) * self.num_kv_heads / self.block_size

    def block_payload_bytes(self, ids: list[int]) -> int:
        """Bytes of blocks `ids` in this cache's layout (what swap space moves; the key summaries of the blocks
        that carry one)."""
        tagged = sum(self.pool.tags_of(ids)) if self.summary_block_bytes else 0
        return len(ids) * self.kv_block_bytes + tagged * self.summary_block_bytes

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
