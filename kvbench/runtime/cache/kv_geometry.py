"""KV geometry: how many bytes and blocks K/V take, from a model's shape, the block size and a dtype.

The one home of these rules, read by the caches, the engine, the app's plan and model_info (before any model is
loaded): plain arithmetic on ints (or on int tensors / arrays, where noted), no tensor allocated, no torch imported.

    element_bytes(dtype)                                   bytes per element: a torch dtype, or its name
    kv_elements(tokens, head_dim)                          K and V elements of `tokens` tokens of one table
    block_bytes(block_size, head_dim, dtype, latent=False) one full-precision block: K and V of block_size tokens
                                                           (latent: one row per token, V read inside K: MLA)
    token_bytes(num_layers, num_kv_heads, head_dim, dtype) one uncompressed token: K and V in every layer and kv-head
    blocks_for_tokens(tokens, block_size)                  blocks a table of `tokens` tokens holds (rounded up)
    codec_block_size(block_size, hint)                     tokens per block for a codec whose groups need `hint`
    pool_blocks(kv_memory_bytes, block_bytes)              blocks a pool of kv_memory_bytes gets (+ the scratch block)
    pool_bytes(num_blocks, block_bytes)                    bytes of a pool of num_blocks blocks (one is the scratch)
    min_pool_blocks(num_layers, num_kv_heads, num_seqs)    the fewest blocks num_seqs sequences can run in

A block is block_size tokens of one (sequence, layer, kv-head) table: its K and V rows, [block_size, head_dim] each.
Every pool keeps one scratch block (id 0) that is never handed out.
"""
from __future__ import annotations

import math
from typing import Any

SCRATCH_BLOCK = 0  # the id of the reserved block every pool keeps (never handed out; writes of padding go there)
SCRATCH_BLOCKS = 1  # how many blocks are reserved

# bytes per element of the model dtypes, by name (kvbench.run.spec.DTYPES)
_NAMED_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def element_bytes(dtype: Any) -> int:
    """Bytes per element of `dtype`: a torch dtype (its itemsize) or a model dtype's name (float32: 4; bfloat16,
    float16: 2)."""
    if isinstance(dtype, str):
        try:
            return _NAMED_ELEMENT_BYTES[dtype.removeprefix("torch.")]
        except KeyError:
            raise ValueError(f"unknown dtype {dtype!r}: choices are {', '.join(_NAMED_ELEMENT_BYTES)}") from None
    return int(dtype.itemsize)


def kv_elements(tokens: Any, head_dim: int) -> Any:
    """K and V elements of `tokens` tokens of one table: 2 x tokens x head_dim (tokens: an int, or an int
    tensor / array)."""
    return 2 * tokens * head_dim


def block_bytes(block_size: int, head_dim: int, dtype: Any, latent: bool = False) -> int:
    """Bytes of one full-precision block: K and V of block_size tokens of one table. latent=True: MLA's cache, one
    row of head_dim (the compressed latent and the decoupled RoPE key) per token, whose values are read inside it."""
    if latent:
        return block_size * head_dim * element_bytes(dtype)
    return kv_elements(block_size, head_dim) * element_bytes(dtype)


def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: Any) -> int:
    """Bytes one token takes uncompressed: K and V in every layer and kv-head."""
    return num_layers * num_kv_heads * kv_elements(1, head_dim) * element_bytes(dtype)


def blocks_for_tokens(tokens: Any, block_size: int) -> Any:
    """Blocks a table of `tokens` tokens holds: ceil(tokens / block_size) (tokens >= 0: an int, or an int
    tensor / array, elementwise)."""
    return (tokens + block_size - 1) // block_size


def codec_block_size(block_size: int, hint: int) -> int:
    """Tokens per block for a codec whose groups need a multiple of `hint` tokens (KIVI keys per channel:
    block_size % group_size == 0): the least multiple of block_size that hint divides."""
    hint = int(hint or 1)
    return block_size * hint // math.gcd(block_size, hint)


def pool_blocks(kv_memory_bytes: int, block_bytes: int) -> int:
    """Blocks of block_bytes a full-precision pool of kv_memory_bytes is given: as many as fit, plus the scratch
    block (at least one block besides it)."""
    return max(1 + SCRATCH_BLOCKS, kv_memory_bytes // block_bytes + SCRATCH_BLOCKS)


def pool_bytes(num_blocks: int, block_bytes: int) -> int:
    """Bytes of K/V a pool of num_blocks blocks of block_bytes holds (the scratch block excluded; at least one)."""
    return max(1, num_blocks - SCRATCH_BLOCKS) * block_bytes


def min_pool_blocks(num_layers: int, num_kv_heads: int, num_seqs: int) -> int:
    """The fewest blocks num_seqs sequences can run in: one per (layer, kv-head) table of each, and the scratch."""
    return num_layers * num_kv_heads * num_seqs + SCRATCH_BLOCKS
