"""The packed rows of a key-channel-pruned block (ThinK): a block's keys in its kept channels only, its values whole.

    key row   [bs, kept] keys of the kept channels, model dtype       bs x kept x element bytes
              [kept] the kept channels' indices (ascending)          kept x index bytes (1 for head_dim <= 256, else 2)
    value row [bs, D] values, model dtype                            bs x D x element bytes

Each key row names its own channels, so a row reads back without any per-sequence table (forks, swap and the prefix
cache move rows as they are) and the indices are counted in the pool's bytes. Reading gives zeros in the pruned
channels: what kvpress's ThinKPress stores (it zeroes them, so q . k ignores them).

`PrunedKeyRows` has the shape of a storage codec (kvbench.quant.codecs) as QuantizedPagedKVCache reads one: byte
sizes, decode of key and value rows, no packing rule of its own (blocks are packed only when a method prunes them:
kvbench.runtime.cache.pruned_key_cache) and no kernel that reads the rows in place (`kernels` is empty: attention
reads a dequantized copy).
"""
from __future__ import annotations

import torch

from kvbench.runtime.cache.kv_geometry import element_bytes


class PrunedKeyRows:
    """Row layout of blocks whose keys keep `kept` of `head_dim` channels, in `dtype` (the model's)."""

    name = "think"
    kernels: tuple[str, ...] = ()  # no kernel reads these rows in place: the cache dequantizes them
    block_size_hint = 1
    fp_block_dtype = None  # full-precision blocks in the model dtype
    pre_rope_keys = False
    residual = 0
    first_token_fp = False
    layer_independent = True

    def __init__(self, head_dim: int, kept: int, dtype: torch.dtype):
        if not 0 < kept <= head_dim:
            raise ValueError(f"kept channels must be in [1, {head_dim}], got {kept}")
        self.head_dim, self.kept, self.dtype = int(head_dim), int(kept), dtype
        self.index_dtype = torch.uint8 if head_dim <= 256 else torch.int16
        self.index_bytes = element_bytes(self.index_dtype)

    # ------------------------------------------------------------------ sizes
    def packed_block_bytes(self, block_size: int, head_dim: int, kind: str) -> int:
        e = element_bytes(self.dtype)
        if kind == "key":
            return block_size * self.kept * e + self.kept * self.index_bytes
        return block_size * head_dim * e

    def packed_block_range(self, n_tokens: int, block_size: int) -> range:
        """Blocks that the codec cache's re-store (token-level eviction) packs by its own rule: none. Moved tokens go
        to full-precision blocks first; PrunedKeyKVCache.keep_tokens then packs those holding pruned tokens only."""
        return range(0)

    def describe(self) -> dict:
        return {"codec": self.name, "kept_key_channels": self.kept, "head_dim": self.head_dim}

    # ------------------------------------------------------------------ encoding and decoding
    def encode_key_rows(self, keys: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
        """keys [n, bs, D] (model dtype), channels [n, kept] ascending kept channels of each block -> rows
        [n, key bytes] uint8."""
        n, bs, _ = keys.shape
        kept = keys.gather(-1, channels[:, None, :].expand(n, bs, self.kept).to(torch.int64))  # [n, bs, kept]
        codes = kept.to(self.dtype).contiguous().view(torch.uint8).reshape(n, -1)
        idx = channels.to(self.index_dtype).contiguous().view(torch.uint8).reshape(n, -1)
        return torch.cat([codes, idx], dim=1)

    def row_channels(self, rows: torch.Tensor) -> torch.Tensor:
        """The kept channels [n, kept] (int64) that key rows [n, key bytes] name."""
        split = rows.shape[1] - self.kept * self.index_bytes
        return _bytes_as(rows[:, split:], self.index_dtype).view(rows.shape[0], self.kept).to(torch.int64)

    def encode_value_rows(self, values: torch.Tensor) -> torch.Tensor:
        """values [n, bs, D] -> rows [n, value bytes] uint8 (the values as they are)."""
        return values.to(self.dtype).contiguous().view(torch.uint8).reshape(values.shape[0], -1)

    def decode_keys(self, rows: torch.Tensor, block_size: int, head_dim: int, layer=None, heads=None, *,
                    dtype: torch.dtype) -> torch.Tensor:
        """rows [n, key bytes] -> keys [n, bs, D] in `dtype`, zeros in the pruned channels."""
        n = rows.shape[0]
        split = block_size * self.kept * element_bytes(self.dtype)
        kept = _bytes_as(rows[:, :split], self.dtype).view(n, block_size, self.kept)
        idx = self.row_channels(rows)  # [n, kept]
        out = torch.zeros(n, block_size, head_dim, dtype=dtype, device=rows.device)
        return out.scatter_(-1, idx[:, None, :].expand(n, block_size, self.kept), kept.to(dtype))

    def decode_values(self, rows: torch.Tensor, block_size: int, head_dim: int, layer=None, heads=None, *,
                      dtype: torch.dtype) -> torch.Tensor:
        """rows [n, value bytes] -> values [n, bs, D] in `dtype`."""
        return _bytes_as(rows, self.dtype).view(rows.shape[0], block_size, head_dim).to(dtype)

    def encode_keys(self, keys: torch.Tensor, layer=None, heads=None) -> torch.Tensor:
        """Packing without a channel set is never asked for (packed_block_range is empty; no pack rule)."""
        raise RuntimeError("pruned key rows are written only by prune_key_channels, which names the channels")

    encode_values = encode_keys


def _bytes_as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes b [n, m] uint8 read as `dtype`, flat: copied where a row's offset or stride does not allow a view
    (a row width that is not a multiple of the element size)."""
    flat = b.reshape(-1)
    if flat.storage_offset() % element_bytes(dtype) or b.stride(0) != b.shape[1]:
        flat = flat.clone()
    return flat.view(dtype)
