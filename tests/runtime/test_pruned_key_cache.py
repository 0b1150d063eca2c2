"""PrunedKeyKVCache (ThinK's layout) reads exactly what a full-precision PagedKVCache with the same channels zeroed
reads, through every operation a method or the engine applies after pruning (token- and block-level eviction, more
appends, pruning again, forks, rollback), and its pool counts the packed rows' bytes."""
from __future__ import annotations

import pytest
import torch

from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.cache.pruned_key_cache import PrunedKeyKVCache
from kvbench.runtime.cache.pruned_key_rows import PrunedKeyRows

L, H, D, BS, P = 2, 2, 8, 4, 3


def _pair():
    plain = PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, num_blocks=256)
    pruned = PrunedKeyKVCache(pruned_channels=P, num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS,
                              max_bytes=256 * 2 * BS * D * 4)
    return plain, pruned


def _append(caches, slots, n, start, g):
    k, v = torch.randn(L, H, n, D, generator=g), torch.randn(L, H, n, D, generator=g)
    for cache, slot in zip(caches, slots):
        plan = cache.prepare_append([slot], torch.arange(start, start + n)[None])
        for layer in range(L):
            cache.write(layer, plan, k[layer][None], v[layer][None])


def _channels(g):
    return torch.stack([torch.randperm(D, generator=g)[:P] for _ in range(H)])  # [H, P]


def _same(caches, slots):
    for layer in range(L):
        (ka, va, pa), (kb, vb, pb) = (c.gather(layer, s) for c, s in zip(caches, slots))
        assert torch.equal(pa, pb)
        held = pa >= 0  # [H, T] (past a shorter head's length the padding is unspecified)
        assert torch.equal(ka[held], kb[held]) and torch.equal(va[held], vb[held])


def test_rows_round_trip():
    rows = PrunedKeyRows(D, D - P, torch.float32)
    k = torch.randn(5, BS, D)
    kept = torch.stack([torch.randperm(D)[: D - P].sort().values for _ in range(5)])
    back = rows.decode_keys(rows.encode_key_rows(k, kept), BS, D, dtype=torch.float32)
    mask = torch.zeros(5, D, dtype=torch.bool).scatter_(1, kept, True)
    assert torch.equal(back, torch.where(mask[:, None, :], k, 0))
    assert torch.equal(rows.row_channels(rows.encode_key_rows(k, kept)), kept)
    assert rows.packed_block_bytes(BS, D, "key") == BS * (D - P) * 4 + (D - P)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 128), (torch.float32, 300)])
def test_rows_round_trip_in_model_dtypes(dtype, head_dim):
    """bf16 / fp16 rows, and 2-byte channel indices past head dim 256; rows read from slices of the pool."""
    kept_n = head_dim - head_dim // 2 - 1  # an odd row width: rows not aligned to the element size
    rows = PrunedKeyRows(head_dim, kept_n, dtype)
    k, v = torch.randn(3, BS, head_dim).to(dtype), torch.randn(3, BS, head_dim).to(dtype)
    kept = torch.stack([torch.randperm(head_dim)[:kept_n].sort().values for _ in range(3)])
    pool = torch.zeros(5, rows.packed_block_bytes(BS, head_dim, "key"), dtype=torch.uint8)
    pool[1:4] = rows.encode_key_rows(k, kept)
    mask = torch.zeros(3, head_dim, dtype=torch.bool).scatter_(1, kept, True)
    for i in range(3):
        back = rows.decode_keys(pool[i + 1: i + 2], BS, head_dim, dtype=dtype)
        assert torch.equal(back[0], torch.where(mask[i][None, :], k[i], 0))
    assert torch.equal(rows.decode_values(rows.encode_value_rows(v), BS, head_dim, dtype=dtype), v)
    assert rows.index_bytes == (2 if head_dim > 256 else 1)


def test_pruned_layout_reads_as_zeroed_keys_through_every_operation():
    g = torch.Generator().manual_seed(0)
    plain, pruned = _pair()
    caches = (plain, pruned)
    slots = [c.add_sequence() for c in caches]
    _append(caches, slots, 19, 0, g)
    for layer in range(L):
        ch = _channels(g)
        for c, s in zip(caches, slots):
            c.prune_key_channels(layer, s, ch)
    _same(caches, slots)
    # 4 full blocks per table packed, the partly filled fifth in full precision
    assert pruned.block_counts() == {"fp": L * H, "packed": L * H * 4}
    rows = PrunedKeyRows(D, D - P, torch.float32)
    packed_bytes = rows.packed_block_bytes(BS, D, "key") + rows.packed_block_bytes(BS, D, "value")
    assert pruned.kv_bytes_in_use() == L * H * (2 * BS * D * 4 + 4 * packed_bytes)
    assert plain.kv_bytes_in_use() - pruned.kv_bytes_in_use() == L * H * 4 * (BS * P * 4 - (D - P))

    # token-level eviction over packed and full-precision blocks (moved tokens are stored again)
    keep = torch.tensor([[0, 1, 2, 3, 5, 8, 9, 13, 17, 18], [4, 5, 6, 7, 8, 9, 10, 11, 12, -1]])
    for c, s in zip(caches, slots):
        c.keep_tokens(0, s, keep)
    _same(caches, slots)
    # layer 0: head 0's first block stays, its moved full block [5, 8, 9, 13] is packed again (pruned tokens only);
    # head 1's blocks [4..7], [8..11] stay; each head's partly filled block stays full precision
    assert pruned.block_counts() == {"fp": L * H, "packed": 4 + H * 4}
    # whole-block eviction, more tokens, pruning again (the union of the channels is zero)
    for c, s in zip(caches, slots):
        c.evict_head_blocks(1, s, [[1], [0, 2]])
    _append(caches, slots, 7, 19, g)
    _same(caches, slots)
    # a token-level eviction that moves generated tokens into a full block: stored in full precision
    before = pruned.block_counts()["packed"]
    ns = pruned.host_lengths[slots[1], 0].tolist()  # [H] (the same in both caches)
    rows = [[t for t in range(n) if t != n - 9] for n in ns]  # one slot before the generated tokens dropped
    keep = torch.tensor([r + [-1] * (max(ns) - 1 - len(r)) for r in rows])
    for c, s in zip(caches, slots):
        c.keep_tokens(0, s, keep)
    _same(caches, slots)
    assert pruned.block_counts()["packed"] <= before
    for layer in range(L):
        ch = _channels(g)
        for c, s in zip(caches, slots):
            c.prune_key_channels(layer, s, ch)
    _same(caches, slots)

    # a fork pruned on its own: the parent's keys stay as they were
    children = [c.fork(s) for c, s in zip(caches, slots)]
    before = [pruned.gather(layer, slots[1])[0].clone() for layer in range(L)]
    ch = _channels(g)
    for c, s in zip(caches, children):
        c.prune_key_channels(0, s, ch)
    _same(caches, children)
    _same(caches, slots)
    assert all(torch.equal(pruned.gather(layer, slots[1])[0], before[layer]) for layer in range(L))

    # rollback
    for c, s in zip(caches, children):
        c.truncate(s, 21)
    _same(caches, children)
    for c, s in zip(caches, slots):
        c.free_sequence(s)
    for c, s in zip(caches, children):
        c.free_sequence(s)
    assert pruned.pool.in_use == 0 and pruned.kv_bytes_in_use() == 0
    pruned.pool.check_consistency()


def test_bad_channel_count_is_refused():
    _, pruned = _pair()
    s = pruned.add_sequence()
    with pytest.raises(ValueError, match="expected"):
        pruned.prune_key_channels(0, s, torch.zeros(H, P + 1, dtype=torch.int64))
