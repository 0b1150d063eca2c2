"""cache.rewrite_tokens: a method overwrites what the held slots store (Finch's re-rotated keys, merged values) in
place; a forked sequence's shared blocks are copied first; a codec cache refuses it."""
from __future__ import annotations

import pytest
import torch

from kvbench.quant.codecs import KiviCodec
from kvbench.runtime.cache.caches import build_cache
from tests.methods.bare_cache import assert_blocks_consistent, coded, make_cache, step


class Keeper:
    """A do-nothing method for bare_cache.step."""
    needs_key_scores = False

    def after_attention(self, ctx):
        pass


def test_rewrite_writes_keys_values_and_positions_of_the_held_slots():
    cache = make_cache(H=2, D=4, bs=4)
    slot = cache.add_sequence()
    k, v = coded(range(10))
    step(Keeper(), cache, slot, k, v, 0, "prefill")
    cache.keep_tokens(0, slot, torch.tensor([[0, 2, 5, 7, 9], [1, 3, 4, -1, -1]]))
    new_k, new_v = torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    cache.rewrite_tokens(0, slot, keys=new_k, values=new_v, positions=torch.arange(5).expand(2, 5))
    gk, gv, gp = cache.gather(0, slot)
    torch.testing.assert_close(gk[0], new_k[0])
    torch.testing.assert_close(gv[0], new_v[0])
    torch.testing.assert_close(gk[1, :3], new_k[1, :3])  # head 1 holds 3 slots: only those written
    assert gp[0].tolist() == [0, 1, 2, 3, 4] and gp[1].tolist() == [0, 1, 2, -1, -1]
    cache.rewrite_tokens(0, slot, values=torch.zeros(2, 5, 4))  # values alone: keys and positions stay
    gk2, gv2, gp2 = cache.gather(0, slot)
    assert torch.equal(gk2, gk) and torch.equal(gp2, gp) and not bool(gv2[:, :3].any())
    assert_blocks_consistent(cache)


def test_rewrite_copies_blocks_shared_with_a_fork_first():
    cache = make_cache(H=2, D=4, bs=4)
    parent = cache.add_sequence()
    k, v = coded(range(8))
    step(Keeper(), cache, parent, k, v, 0, "prefill")
    child = cache.fork(parent)
    cache.rewrite_tokens(0, child, values=torch.full((2, 8, 4), 7.0))
    assert bool((cache.gather(0, child)[1] == 7).all())
    torch.testing.assert_close(cache.gather(0, parent)[1], v)  # the parent's blocks untouched
    assert_blocks_consistent(cache)


def test_a_codec_cache_refuses_rewrite():
    cache = build_cache(codec=KiviCodec(bits=2, group_size=16, residual=16), kv_memory_bytes=1 << 16, num_layers=1,
                        num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, device="cpu")
    slot = cache.add_sequence()
    with pytest.raises(RuntimeError, match="full-precision cache"):
        cache.rewrite_tokens(0, slot, values=torch.zeros(2, 1, 16))
