"""Block pool and paged cache bookkeeping: no leaks, exact block counts, no copies on decode."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.runtime.cache.block_pool import BlockPool, OutOfBlocksError
from kvbench.runtime.cache.kv_cache import PagedKVCache

L, H, D = 2, 2, 4


def make_cache(bs=4, num_blocks=400):
    return PagedKVCache(num_layers=L, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=num_blocks, max_seqs=4)


def append(cache, slot, n, start):
    pos = torch.arange(start, start + n).unsqueeze(0)
    plan = cache.prepare_append([slot], pos)
    for layer in range(L):
        # value = position + 1000*layer + 100*head, so moved data can be traced
        val = (pos[:, None, :, None] + 1000 * layer + 100 * torch.arange(H)[None, :, None, None]).float()
        cache.write(layer, plan, val.expand(1, H, n, D), -val.expand(1, H, n, D))


def random_keep(lens, n, g):
    """keep_tokens' argument [H, K] dropping n random tokens of each head's lens[h] (-1 pads)."""
    keep = torch.full((H, int(lens.max())), -1, dtype=torch.int64)
    for h in range(H):
        m = int(lens[h])
        chosen = torch.randperm(m, generator=g)[: max(0, m - n)].sort().values
        keep[h, : chosen.numel()] = chosen
    return keep[:, : max(1, int((keep >= 0).sum(-1).max()))]


def assert_tables_consistent(cache):
    bs = cache.block_size
    expected = 0
    for s in cache.live:
        for layer in range(L):
            for h in range(H):
                n = int(cache.lengths[s, layer, h])
                expected += math.ceil(n / bs)
                # every valid slot holds the token recorded at its position
                if n:
                    k, _, pos = cache.gather(layer, s)
                    assert torch.equal(k[h, :n, 0], (pos[h, :n] + 1000 * layer + 100 * h).float())
    blocks = set()
    for s in cache.live:
        nb = cache._num_blocks(cache.lengths[s])
        for layer in range(L):
            for h in range(H):
                blocks.update(cache.tables[s, layer, h, : int(nb[layer, h])].tolist())
    assert len(blocks) == cache.pool.in_use  # distinct blocks referenced == blocks the pool says are in use
    cache.pool.check_consistency()
    return expected


def test_pool_allocate_free_and_peak():
    pool = BlockPool(10)
    a = pool.allocate(4)
    b = pool.allocate(5)
    assert pool.in_use == 9 and pool.peak_in_use == 9
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    assert pool.in_use == 9  # a failed allocation changes nothing
    pool.free(a)
    pool.share(b)
    pool.free(b)
    assert pool.in_use == 5  # shared blocks survive one free
    pool.free(b)
    assert pool.in_use == 0 and pool.peak_in_use == 9
    with pytest.raises(ValueError):
        pool.free([b[0]])
    pool.check_consistency()


def test_pool_counts_summary_tagged_blocks_at_their_size():
    """Blocks tagged as they are allocated (a retrieving layer's, carrying a key summary) cost more: the bytes in use,
    shared and at the peak are counted per kind through allocation, sharing, freeing, a cached free block taken
    back and a reset; the peak is that of the true total (not the block peak times the larger size)."""
    pool = BlockPool(12, reserved=1)
    pool.set_block_bytes(100, 130, default_tag=1)
    depth = {}
    pool.retain_rank = depth.get
    a = pool.allocate(4, [1, 0, 0, 1])
    assert pool.tags_of(a) == [1, 0, 0, 1] and pool.tagged_in_use == 2
    assert pool.bytes_in_use() == 4 * 100 + 2 * 30 == pool.peak_bytes
    b = pool.allocate(2)  # no tags given: the default (tagged)
    assert pool.tags_of(b) == [1, 1] and pool.bytes_in_use() == 6 * 100 + 4 * 30
    pool.share([a[0], a[1]])
    assert pool.shared_bytes() == 130 + 100
    pool.free([a[0], a[1]])  # the second references
    assert pool.shared_bytes() == 0 and pool.bytes_in_use() == 720
    pool.free(b)
    assert pool.bytes_in_use() == 4 * 100 + 2 * 30 and pool.peak_bytes == 720
    c = pool.allocate(6, [0] * 6)  # more blocks than the peak's 6, fewer bytes: the block peak is not the byte peak
    assert pool.in_use == 10 and pool.peak_in_use == 10
    assert pool.bytes_in_use() == 10 * 100 + 2 * 30 == pool.peak_bytes  # 1060 < 10 x 130
    pool.free(c)
    depth[a[0]] = 0  # a prefix cache names a[0]: freed, it stays cached with its tag
    pool.free([a[0]])
    assert pool.bytes_in_use() == 3 * 100 + 30 and pool.tags_of([a[0]]) == [1]
    pool.reset_peak()
    assert pool.peak_bytes == 330
    pool.share([a[0]])  # taken back: a tagged block again, and the peak follows
    assert pool.bytes_in_use() == pool.peak_bytes == 4 * 100 + 2 * 30
    with pytest.raises(ValueError, match="2 tags for 3 blocks"):
        pool.allocate(3, [1, 0])
    pool.check_consistency()


def test_blocks_in_use_equal_ceil_tokens_over_block_size():
    cache = make_cache(bs=4)
    s = cache.add_sequence()
    append(cache, s, 13, 0)
    assert cache.pool.in_use == L * H * math.ceil(13 / 4)
    append(cache, s, 1, 13)
    append(cache, s, 2, 14)
    assert cache.pool.in_use == L * H * math.ceil(16 / 4)
    append(cache, s, 1, 16)
    assert cache.pool.in_use == L * H * 5
    assert cache.peak_kv_bytes() == cache.pool.peak_in_use * cache.bytes_per_block
    assert cache.bytes_per_block == 2 * 4 * D * 4
    cache.free_sequence(s)
    assert cache.pool.in_use == 0


def test_decode_step_copies_no_cached_kv():
    cache = make_cache(bs=4)
    s = cache.add_sequence()
    append(cache, s, 30, 0)
    k_ptr = cache.k_pool.data_ptr()
    before = cache.k_pool.view(torch.int32).clone(), cache.v_pool.view(torch.int32).clone()  # bitwise
    pos = torch.tensor([[30]])
    plan = cache.prepare_append([s], pos)
    new_rows = set(plan.write_index.reshape(-1).tolist())
    assert len(new_rows) == L * H  # one row per layer-head table, nothing else
    for layer in range(L):
        cache.write(layer, plan, torch.full((1, H, 1, D), 7.0), torch.full((1, H, 1, D), 7.0))
    assert cache.k_pool.data_ptr() == k_ptr
    changed = (cache.k_pool.view(torch.int32) != before[0]).any(-1).reshape(-1).nonzero().flatten().tolist()
    assert set(changed) <= new_rows and len(changed) == L * H
    assert torch.equal((cache.v_pool.view(torch.int32) != before[1]).any(-1).reshape(-1).nonzero().flatten().sort().values,
                       torch.tensor(sorted(new_rows)))


def test_fork_is_copy_on_write():
    cache = make_cache(bs=4)
    a = cache.add_sequence()
    append(cache, a, 6, 0)
    used = cache.pool.in_use
    b = cache.fork(a)
    assert cache.pool.in_use == used  # shared, not copied
    append(cache, b, 1, 6)  # writes into the shared partial block -> private copy
    k_a, _, pos_a = cache.gather(0, a)
    k_b, _, pos_b = cache.gather(0, b)
    assert pos_a.shape[1] == 6 and pos_b.shape[1] == 7
    assert torch.equal(k_a[0, :6], k_b[0, :6])
    cache.free_sequence(a)
    cache.free_sequence(b)
    assert cache.pool.in_use == 0
    cache.pool.check_consistency()


def test_out_of_blocks_is_a_typed_error_and_changes_nothing():
    cache = make_cache(bs=4, num_blocks=1 + L * H * 2)
    s = cache.add_sequence()
    append(cache, s, 8, 0)
    lengths = cache.lengths.clone()
    with pytest.raises(OutOfBlocksError):
        cache.prepare_append([s], torch.tensor([[8]]))
    assert torch.equal(cache.lengths, lengths)
    cache.free_sequence(s)
    assert cache.pool.in_use == 0


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "keep", "evict_block", "fork", "free"]),
              st.integers(0, 3), st.integers(1, 9), st.integers(0, 10_000)),
    min_size=1, max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, bs=st.sampled_from([1, 2, 4]))
def test_random_operations_never_leak(ops, bs):
    cache = make_cache(bs=bs, num_blocks=2000)
    seqs: list[int] = []
    nxt: dict[int, int] = {}
    for op, which, n, seed in ops:
        g = torch.Generator().manual_seed(seed)
        if op == "new" or not seqs:
            s = cache.add_sequence()
            seqs.append(s)
            nxt[s] = 0
            continue
        s = seqs[which % len(seqs)]
        if op == "append":
            append(cache, s, n, nxt[s])
            nxt[s] += n
        elif op == "keep":
            layer = which % L
            cache.keep_tokens(layer, s, random_keep(cache.lengths[s, layer], n, g))
        elif op == "evict_block":
            layer, h = which % L, (which // L) % H
            m = int(cache.lengths[s, layer, h])
            full = m // bs
            if full:
                cache.evict_blocks(layer, s, h, [n % full])
        elif op == "fork":
            c = cache.fork(s)
            seqs.append(c)
            nxt[c] = nxt[s]
        elif op == "free":
            cache.free_sequence(s)
            seqs.remove(s)
        assert_tables_consistent(cache)
    for s in list(seqs):
        cache.free_sequence(s)
    assert cache.pool.in_use == 0
    cache.pool.check_consistency()



def test_evict_head_blocks_equals_one_head_at_a_time():
    """Dropping different blocks in each kv-head in one call leaves the same tables, positions, lengths and free
    blocks as evict_blocks head by head; a part-filled last block is refused."""
    bs = 4
    a, b = make_cache(bs), make_cache(bs)
    for cache in (a, b):
        s = cache.add_sequence()
        append(cache, s, 26, 0)  # 6 full blocks + 2 tokens per table
    drops = [[1, 4], [0, 2, 5]]
    a.evict_head_blocks(1, s, drops)
    for h, drop in enumerate(drops):
        b.evict_blocks(1, s, h, drop)
    assert torch.equal(a.lengths, b.lengths) and a.lengths[s, 1].tolist() == [18, 14]
    assert torch.equal(a.tables, b.tables) and torch.equal(a.positions, b.positions)
    assert a.pool.in_use == b.pool.in_use == 2 * 7 + 5 + 4
    k, _, pos = a.gather(1, s)
    assert pos[0, :18].tolist() == [p for p in range(26) if p // bs not in (1, 4)]
    assert pos[1, :14].tolist() == [p for p in range(26) if p // bs not in (0, 2, 5)]
    assert torch.equal(k[0, :18, 0], pos[0, :18].float() + 1000 + 0)  # the data stayed with its position
    with pytest.raises(ValueError, match="not a full block"):
        a.evict_head_blocks(0, s, [[6], []])
    assert_tables_consistent(a)


def test_evict_the_same_blocks_in_every_head_equals_one_head_at_a_time():
    """heads="shared" eviction (every kv-head drops the same blocks, tables equally long) takes one set of tensor ops
    for all heads; it leaves the same tables, positions, lengths and pool as evict_blocks head by head."""
    bs = 4
    a, b = make_cache(bs), make_cache(bs)
    for cache in (a, b):
        s = cache.add_sequence()
        append(cache, s, 26, 0)
    a.evict_head_blocks(1, s, [[4, 1], [4, 1]])
    for h in range(2):
        b.evict_blocks(1, s, h, [1, 4])
    assert a.lengths[s, 1].tolist() == [18, 18]
    assert torch.equal(a.lengths, b.lengths) and torch.equal(a.positions, b.positions)
    assert torch.equal(a.tables[s, 1, :, :5], b.tables[s, 1, :, :5])  # the live columns
    assert a.pool.in_use == b.pool.in_use and sorted(a.pool._free) == sorted(b.pool._free)
    k, _, pos = a.gather(1, s)
    assert pos[1, :18].tolist() == [p for p in range(26) if p // bs not in (1, 4)]
    assert torch.equal(k[1, :18, 0], pos[1, :18].float() + 1000 + 100)  # the data stayed with its position
    with pytest.raises(ValueError, match="not a full block"):
        a.evict_head_blocks(1, s, [[4], [4]])  # now the part-filled last block
    assert_tables_consistent(a)


def test_cached_free_blocks_are_taken_last_oldest_first_tail_first_and_can_be_taken_back():
    """A prefix cache's view of the pool (vLLM's evictable cached blocks): freed blocks it names stay cached and
    count as free; an allocation takes plain free blocks first, then evicts cached ones least recently freed first
    and, among blocks freed together, the deepest first, telling the listeners; `share` takes a cached block back."""
    pool = BlockPool(12, reserved=1)  # 11 usable
    depth = {}  # block -> depth in a cached prompt (the prefix cache's answer)
    evicted = []
    pool.retain_rank = depth.get
    pool.evict_listeners.append(evicted.extend)
    a = pool.allocate(3)
    b = pool.allocate(3)
    depth.update({a[0]: 0, a[1]: 1, a[2]: 2, b[0]: 0, b[1]: 1})  # b[2] is not cached
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 11 and pool.in_use == 0 and pool.num_cached_free == 5
    assert pool.count_cached_free(torch.tensor([a, b], dtype=torch.int32)) == 5
    pool.check_consistency()
    got = pool.allocate(6)  # the 5 never-cached plain blocks and b[2] first: nothing evicted
    assert b[2] in got and not evicted and pool.num_cached_free == 5
    pool.allocate(2)  # now a's deepest blocks go first (a was freed before b)
    assert evicted == [a[2], a[1]]
    pool.share([b[0], b[1]])  # a hit on b's cached blocks takes them back
    assert pool.refcount(b[0]) == pool.refcount(b[1]) == 1 and pool.shared_refs == 0
    assert pool.num_cached_free == 1 and pool.in_use == 10
    pool.uncache([a[0]])  # the cache dropped what a[0] held: a plain free block now
    assert pool.num_cached_free == 0 and pool.num_free == 1
    with pytest.raises(ValueError):
        pool.share([a[0]])  # a plain free block cannot be shared
    assert pool.allocate(1) == [a[0]]
    pool.check_consistency()


def test_without_a_prefix_cache_the_pool_keeps_no_cached_blocks():
    pool = BlockPool(6, reserved=1)
    ids = pool.allocate(5)
    pool.free(ids)
    assert pool.num_cached_free == 0 and pool.num_free == 5
    assert pool.allocate(5) == ids  # the stack order as before: the first released comes out first again


def _assert_same_plan(a, b):
    for name in ("slots", "write_index", "tables", "lengths", "query_positions", "positions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.slot_list == b.slot_list and (a.host_lengths == b.host_lengths).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "decode", "append", "keep", "evict_block", "fork", "free"]),
                              st.integers(0, 3), st.integers(1, 9), st.integers(0, 10_000)), min_size=1, max_size=30),
       bs=st.sampled_from([1, 2, 4]))
def test_host_decode_append_builds_the_general_paths_plan(ops, bs):
    """A decode append on CPU (numpy on views of the tables) leaves the cache and returns the plan exactly as the
    general torch path does, through allocation, eviction, forks and frees: one cache of each, run in lockstep."""
    fast, slow = make_cache(bs=bs, num_blocks=2000), make_cache(bs=bs, num_blocks=2000)
    slow.host_decode_appends = False
    for c in (fast, slow):  # stale bytes, as a reused block holds: fresh blocks must come out zeroed in both
        c.k_pool.fill_(7.0)
        c.v_pool.fill_(7.0)
    seqs, nxt = [], {}
    for op, which, n, seed in ops:
        if op == "new" or not seqs:
            s = fast.add_sequence()
            assert slow.add_sequence() == s
            seqs.append(s)
            nxt[s] = 0
            continue
        s = seqs[which % len(seqs)]
        if op == "decode":  # one token for every live sequence, one call
            pos = torch.tensor([[nxt[x]] for x in seqs])
            plans = [c.prepare_append(list(seqs), pos.clone()) for c in (fast, slow)]
            _assert_same_plan(*plans)
            for x in seqs:
                nxt[x] += 1
            for c, plan in zip((fast, slow), plans):
                for layer in range(L):
                    val = torch.randn(len(seqs), H, 1, D, generator=torch.Generator().manual_seed(seed + layer))
                    c.write(layer, plan, val, -val)
        elif op == "append":
            for c in (fast, slow):
                append(c, s, n, nxt[s])
            nxt[s] += n
        elif op == "keep":
            layer = which % L
            keep = random_keep(fast.lengths[s, layer], n, torch.Generator().manual_seed(seed))
            for c in (fast, slow):
                c.keep_tokens(layer, s, keep)
        elif op == "evict_block":
            layer, h = which % L, (which // L) % H
            full = int(fast.lengths[s, layer, h]) // bs
            if full:
                for c in (fast, slow):
                    c.evict_blocks(layer, s, h, [n % full])
        elif op == "fork":
            c = fast.fork(s)
            assert slow.fork(s) == c
            seqs.append(c)
            nxt[c] = nxt[s]
        elif op == "free":
            for c in (fast, slow):
                c.free_sequence(s)
            seqs.remove(s)
        for name in ("tables", "lengths", "positions", "k_pool", "v_pool"):
            assert torch.equal(getattr(fast, name), getattr(slow, name)), name
        assert (fast.host_lengths == slow.host_lengths).all() and fast.tokens_seen == slow.tokens_seen
        assert fast.pool.in_use == slow.pool.in_use
