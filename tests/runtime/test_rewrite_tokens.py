"""cache.rewrite_tokens: a method overwrites what the held slots store (Finch's re-rotated keys, merged values) in
place; a forked sequence's shared blocks are copied first; a codec cache refuses it. cache.continue_positions_at:
the tokens after a re-indexed prompt take the continued positions in every append path, forks and rollback."""
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


# ------------------------------------------------------------------------ continue_positions_at
def reindexed(cache, keep: list[int]):
    """A 10-token sequence compressed to `keep` and re-indexed to 0..n-1 (Finch's re-rotation), positions then
    continued at n: the slot."""
    slot = cache.add_sequence()
    k, v = coded(range(10))
    step(Keeper(), cache, slot, k, v, 0, "prefill")
    n = len(keep)
    cache.keep_tokens(0, slot, torch.tensor([keep, keep]))
    cache.rewrite_tokens(0, slot, positions=torch.arange(n).expand(2, n))
    cache.continue_positions_at(slot, n)
    return slot


@pytest.mark.parametrize("host_decode_appends", [True, False], ids=["host_decode", "general"])
def test_appends_after_continue_positions_at_take_the_continued_positions(host_decode_appends):
    """The positions a caller passes are token indices; the cache lowers them by the sequence's shift in every
    append path (a chunk, a one-token decode step on the host path or the general one), in the plan (RoPE reads
    it) and in the cached positions."""
    cache = make_cache(H=2, D=4, bs=4)
    cache.host_decode_appends = host_decode_appends
    slot = reindexed(cache, [1, 4, 8, 9])
    other = cache.add_sequence()  # an unshifted sequence in the same step keeps its own positions
    plan = cache.prepare_append([slot, other], torch.tensor([[10, 11], [0, 1]]))
    assert plan.query_positions.tolist() == [[4, 5], [0, 1]]
    plan = cache.prepare_append([slot], torch.tensor([[12]]))
    assert plan.query_positions.tolist() == [[6]]
    assert cache.positions[slot, 0, 0, :7].tolist() == list(range(7))
    assert cache.tokens_seen[slot] == 13  # tokens, not positions


def test_a_fork_continues_as_its_parent_and_a_reused_slot_starts_unshifted():
    cache = make_cache(H=2, D=4, bs=4)
    slot = reindexed(cache, [0, 5, 9])
    child = cache.fork(slot)
    assert cache.prepare_append([child], torch.tensor([[10]])).query_positions.tolist() == [[3]]
    cache.free_sequence(child)
    cache.free_sequence(slot)
    again = cache.add_sequence()
    assert again in (slot, child)
    assert cache.prepare_append([again], torch.tensor([[0, 1]])).query_positions.tolist() == [[0, 1]]


def test_truncate_counts_tokens_on_a_shifted_sequence():
    """truncate(slot, num_tokens) keeps the first num_tokens tokens (speculative decoding's rollback) whatever
    positions they took."""
    cache = make_cache(H=2, D=4, bs=4)
    slot = reindexed(cache, [2, 3, 7, 9])
    k, v = coded(range(10, 15))
    cache.write(0, cache.prepare_append([slot], torch.arange(10, 15)[None]), k[None], v[None])  # positions 4..8
    cache.truncate(slot, 12)  # the prompt's 10 tokens and 2 more
    assert cache.lengths[slot, 0].tolist() == [6, 6]
    assert cache.gather(0, slot)[2][0].tolist() == list(range(6))
    assert cache.tokens_seen[slot] == 12
    assert_blocks_consistent(cache)


def test_continue_positions_at_refuses_a_position_past_the_sequence():
    cache = make_cache(H=2, D=4, bs=4)
    slot = cache.add_sequence()
    step(Keeper(), cache, slot, *coded(range(3)), 0, "prefill")
    with pytest.raises(ValueError, match="past sequence"):
        cache.continue_positions_at(slot, 4)
