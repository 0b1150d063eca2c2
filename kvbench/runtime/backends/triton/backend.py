"""The Triton backend: on CUDA (keys cached after RoPE), decode steps through the split-KV decode kernel (decode.py),
over full-precision pools and over the packed blocks of a codec that lists "triton_attention" (KIVI, int8), read in
place; chunked prefill and scoring through the paged-attention kernel (attention.py). Imported only when chosen
(backends/selection.py, through triton.load)."""
from __future__ import annotations

import torch

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.triton.attention import paged_attention_triton
from kvbench.runtime.backends.triton.decode import codec_readable, paged_decode_triton


def _is_decode(q: torch.Tensor, rotate_keys, causal: bool) -> bool:
    return q.shape[2] == 1 and not causal and rotate_keys is None


class TritonBackend(AttentionBackend):
    """Split-KV decode and paged prefill attention in Triton (key scores cover every slot of the tables' width)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None):
        self.num_splits = num_splits  # None: from the device (decode.default_num_splits)

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
               return_key_scores=False, rotate_keys=None, causal=True):
        if _is_decode(q, rotate_keys, causal):
            return paged_decode_triton(q, k_pool, v_pool, tables, lengths, scale,
                                       return_key_scores=return_key_scores, num_splits=self.num_splits)
        res = paged_attention_triton(q, k_pool, v_pool, tables, lengths.to(torch.int32), key_positions,
                                     query_positions.to(torch.int32), scale, return_key_scores=return_key_scores)
        return res if return_key_scores else (res, None)

    def attend_packed(self, cache, layer, q, plan, scale, *, return_key_scores=False, rotate_keys=None,
                      causal=True):
        if not (_is_decode(q, rotate_keys, causal) and codec_readable(cache.codec)):
            return None  # the cache dequantizes and calls attend
        return paged_decode_triton(q, cache.k_pool, cache.v_pool, plan.tables[:, layer], plan.lengths[:, layer],
                                   scale, return_key_scores=return_key_scores, num_splits=self.num_splits,
                                   codec=cache.codec, kq_pool=cache.kq_pool, vq_pool=cache.vq_pool)
