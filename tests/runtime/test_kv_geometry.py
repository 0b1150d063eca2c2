"""kvbench.runtime.cache.kv_geometry: the sizes every caller reads agree with the tensors a cache allocates."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvbench.runtime.cache import kv_geometry as geo
from kvbench.runtime.cache.caches import build_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_and_token_bytes_are_what_the_pool_tensors_take(dtype):
    cache = build_cache(codec=None, kv_memory_bytes=1 << 16, num_layers=3, num_kv_heads=2, head_dim=16,
                        block_size=8, dtype=dtype, device="cpu")
    assert geo.block_bytes(8, 16, dtype) == cache.k_pool[0].nbytes + cache.v_pool[0].nbytes
    assert geo.block_bytes(8, 16, str(dtype).removeprefix("torch.")) == geo.block_bytes(8, 16, dtype)
    assert geo.token_bytes(3, 2, 16, dtype) == 3 * 2 * (cache.k_pool[0, 0].nbytes + cache.v_pool[0, 0].nbytes)
    assert cache.pool.num_blocks == geo.pool_blocks(1 << 16, geo.block_bytes(8, 16, dtype))
    assert geo.pool_bytes(cache.pool.num_blocks, cache.bytes_per_block) == cache.pool_bytes()


def test_block_counts_round_up_elementwise():
    assert [geo.blocks_for_tokens(n, 8) for n in (0, 1, 8, 9, 16)] == [0, 1, 1, 2, 2]
    assert geo.blocks_for_tokens(torch.tensor([0, 7, 8, 17]), 8).tolist() == [0, 1, 1, 3]
    assert geo.min_pool_blocks(30, 3, 2) == 181  # a block per table and the scratch block
    assert geo.pool_blocks(10, 64) == 2 and geo.pool_bytes(1, 64) == 64  # never fewer than one usable block


@pytest.mark.parametrize("block_size,hint,tokens", [(16, 1, 16), (16, 32, 32), (24, 32, 96), (64, 32, 64)])
def test_codec_block_size_is_the_least_multiple_the_groups_fit(block_size, hint, tokens):
    assert geo.codec_block_size(block_size, hint) == tokens


def test_unknown_dtype_names_are_refused():
    with pytest.raises(ValueError, match="float32"):
        geo.element_bytes("float64x")


def test_importing_it_loads_neither_torch_nor_a_model():
    code = "import sys, kvbench.runtime.cache.kv_geometry; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
