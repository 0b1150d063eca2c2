"""The CPU backend: the C kernels of kernels.py for attention over full-precision and codec caches, and the fused
decode step of fused_decode.py."""
from __future__ import annotations

import weakref

import torch

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.cpu import kernels
from kvbench.runtime.backends.cpu.fused_decode import fused_decode_step

MAX_PACKED_GROUP = 8  # query heads per kv-head up to which the codec kernels run


class CpuBackend(AttentionBackend):
    """`kernels.paged_attention_cpu` over full-precision pools (C decode and prefill kernels where they apply, the
    torch reference otherwise); the C codec kernels over packed blocks; whole decode layers per C call."""

    name = "cpu"
    fuses_decode = True

    def __init__(self):
        self._formats = weakref.WeakKeyDictionary()  # codec cache or its view -> (key, value) BlockFormat, or None

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
               return_key_scores=False, rotate_keys=None, causal=True):
        return kernels.paged_attention_cpu(q, k_pool, v_pool, tables, lengths, key_positions, query_positions,
                                           scale, return_key_scores=return_key_scores, rotate_keys=rotate_keys,
                                           causal=causal)

    def attend_packed(self, cache, layer, q, plan, scale, *, return_key_scores=False, rotate_keys=None,
                      causal=True):
        kind = self.packed_kernel(cache, q, rotate_keys=rotate_keys, causal=causal,
                                  return_key_scores=return_key_scores)
        if kind is None:
            return None
        formats = self._formats[cache]
        tables, lengths = plan.tables[:, layer], plan.lengths[:, layer]
        if kind == "decode":
            return kernels.codec_decode_attention_cpu(
                q, cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool, formats, tables, lengths, scale,
                return_key_scores=return_key_scores)
        out = kernels.codec_prefill_attention_cpu(
            q, cache.k_pool, cache.v_pool, cache.kq_pool, cache.vq_pool, formats, tables, lengths,
            cache.positions[plan.slots, layer], plan.query_positions, scale)
        return out, None

    def packed_kernel(self, cache, q: torch.Tensor, *, rotate_keys=None, causal: bool = True,
                      return_key_scores: bool = False) -> str | None:
        """Which C kernel reads this step over a codec cache: "decode" (one query per sequence, no mask) or
        "prefill" (a causal chunk, no per-key mass), for fp32 queries over keys cached after RoPE, at most
        MAX_PACKED_GROUP query heads per kv-head and a codec the kernels read (`block_formats`); else None."""
        if rotate_keys is not None or q.dtype != torch.float32:
            return None
        Q = q.shape[2]
        kind = "decode" if not causal and Q == 1 else "prefill" if causal and Q != 1 and not return_key_scores \
            else None
        if kind is None or q.device.type != "cpu" or self.codec_formats(cache, q.shape[1]) is None:
            return None
        return kind

    def codec_formats(self, cache, num_heads: int) -> tuple | None:
        """`block_formats` of a codec cache (or its DecodePools view) that the C codec kernels read for a model of
        `num_heads` query heads (an fp32 cache, at most MAX_PACKED_GROUP query heads per kv-head), else None."""
        if cache.dtype != torch.float32 or num_heads // cache.num_kv_heads > MAX_PACKED_GROUP:
            return None
        return self.block_formats(cache)

    def block_formats(self, cache) -> tuple | None:
        """(key, value) `kernels.BlockFormat` of a codec cache's packed rows, or None when the kernels cannot read
        them (the codec does not list "cpu_attention", the head dim, full-precision blocks neither fp16 nor fp32,
        no C kernels). Worked out once per cache (or per cache's DecodePools view: the cache keeps one)."""
        if cache not in self._formats:
            formats = tuple(kernels.codec_block_format(cache.codec, kind, cache.block_size, cache.head_dim)
                            for kind in ("key", "value"))
            ok = None not in formats and cache.fp_dtype in (torch.float16, torch.float32) and kernels.available()
            self._formats[cache] = formats if ok else None
        return self._formats[cache]

    def fused_decode(self, weights, tokens, pools, plan, rope_mode, cos, sin, need_scores, retrieval=None):
        formats = None
        if not pools.plain:  # a codec cache: fused where the codec decode kernel reads it (as attend_packed)
            formats = self.codec_formats(pools, weights.num_heads)
            if formats is None:
                return None
        return fused_decode_step(weights, tokens, pools, plan, rope_mode, cos, sin, need_scores, formats, retrieval)


CPU = CpuBackend()
