"""A bare one-layer PagedKVCache for hand-made method cases: the cache, one step that appends K/V and calls the
method as the engine does, K/V that name their tokens, and readers of which tokens stayed."""
from __future__ import annotations

import torch

from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.hooks import LayerContext


def make_cache(H=2, D=4, bs=4, **kw) -> PagedKVCache:
    return PagedKVCache(num_layers=1, num_kv_heads=H, head_dim=D, block_size=bs, num_blocks=512, **kw)


def step(method, cache, slot, k, v, start, phase, *, q=None, last_chunk=True, key_scores=None):
    """Append k, v [H, Q, D] at positions start.., then call the method like the engine does."""
    H, Q, D = k.shape
    plan = cache.prepare_append([slot], torch.arange(start, start + Q)[None])
    cache.write(0, plan, k[None], v[None])
    if q is None:
        q = torch.zeros(1, H, Q, D)
    if method.needs_key_scores and key_scores is None:
        _, key_scores = cache.attend(0, q, plan, D ** -0.5, backend=TORCH,
                                     return_key_scores=True, causal=Q > 1)
    method.after_attention(LayerContext(0, cache, plan, phase, last_chunk, q, key_scores))
    return plan


def positions(cache, slot, h=0):
    return cache.positions[slot, 0, h, : int(cache.lengths[slot, 0, h])].tolist()


def coded(pos, H=2, D=4):
    """K/V that name their token: k[h, t] = position, v = -position (all dims)."""
    p = torch.as_tensor(pos, dtype=torch.float32)
    return p[None, :, None].expand(H, -1, D).clone(), -p[None, :, None].expand(H, -1, D).clone()


def assert_blocks_consistent(cache):
    bs = cache.block_size
    want = sum(int(((cache.lengths[s] + bs - 1) // bs).sum()) for s in cache.live)
    assert cache.pool.in_use == want
    cache.pool.check_consistency()
