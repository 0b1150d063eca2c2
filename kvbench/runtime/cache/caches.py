"""The one place a KV cache is built: full precision, or a storage codec's packed layout.

    cache = build_cache(codec=None, kv_memory_bytes=2**30, num_layers=30, num_kv_heads=3, head_dim=64,
                        block_size=16, dtype=torch.float32, device="cpu")

`kv_memory_bytes` is the KV memory the pool may hold at once, in bytes, whatever the layout: a full-precision cache
gets kv_memory_bytes // bytes-per-block blocks; a codec's cache may spend the same bytes on packed and
full-precision blocks in any mix, so a compressed cache holds more tokens in the same memory. The sizes are
kvbench.runtime.cache.kv_geometry's.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from kvbench.runtime.cache import kv_geometry
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.cache.pruned_key_cache import PrunedKeyKVCache
from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache


def codec_block_size(codec: Any, block_size: int) -> int:
    """Tokens per block for `codec`: the least multiple of block_size that the codec's groups fit (KIVI keys
    per channel need block_size % G == 0; kv_geometry.codec_block_size of its block_size_hint)."""
    return kv_geometry.codec_block_size(block_size, int(getattr(codec, "block_size_hint", 1) or 1))


def build_cache(*, codec: Optional[Any], kv_memory_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, device: Any, max_seqs: int = 64,
                store_pre_rope: bool = False, pruned_key_channels: int = 0,
                value_dim: Optional[int] = None) -> PagedKVCache:
    """A PagedKVCache (codec None or "full"), a QuantizedPagedKVCache, or (pruned_key_channels > 0: a method
    prunes that many key channels per kv-head, ThinK) a PrunedKeyKVCache, holding at most kv_memory_bytes.
    value_dim: a latent cache (MLA: values inside the keys; full precision or a codec that `latent_codec` accepts)."""
    common = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                  device=device, max_seqs=max_seqs)
    if pruned_key_channels:
        if value_dim is not None:
            raise ValueError("pruned key channels (ThinK) and MLA's latent cache both choose the layout")
        if codec is not None and getattr(codec, "name", "full") != "full":
            raise ValueError(f"pruned key channels and the storage codec {codec.name!r} both choose the layout")
        if store_pre_rope:
            raise ValueError("pruned key channels need keys cached after RoPE")
        return PrunedKeyKVCache(pruned_channels=int(pruned_key_channels), block_size=block_size,
                                max_bytes=int(kv_memory_bytes), **common)
    if codec is None or getattr(codec, "name", "full") == "full":
        latent = value_dim is not None
        num_blocks = kv_geometry.pool_blocks(kv_memory_bytes,
                                             kv_geometry.block_bytes(block_size, head_dim, dtype, latent))
        return PagedKVCache(block_size=block_size, num_blocks=int(num_blocks), store_pre_rope=store_pre_rope,
                            value_dim=value_dim, **common)
    if value_dim is not None and not latent_codec(codec):
        raise ValueError(f"quant {getattr(codec, 'name', codec)!r}: this storage codec cannot store MLA's latent "
                         f"cache (its levels and ranges are calibrated per layer on keys before RoPE); "
                         f"run it with quant=none, kivi, int8 or fp8")
    pre_rope = store_pre_rope or bool(getattr(codec, "pre_rope_keys", False))
    return QuantizedPagedKVCache(codec=codec, block_size=codec_block_size(codec, block_size),
                                 max_bytes=int(kv_memory_bytes), store_pre_rope=pre_rope, value_dim=value_dim,
                                 **common)


def latent_codec(codec: Any) -> bool:
    """Whether `codec` can store MLA's latent rows: one row [latent ; RoPE key] per token packed through its key
    encoding (values decoded from the rows), which needs an encoding that ignores layer and head and reads keys after
    RoPE (KIVI, int8, fp8; not KVQuant)."""
    return bool(getattr(codec, "layer_independent", False)) and not getattr(codec, "pre_rope_keys", False)
