"""The torch backend: the reference attention for every device, dtype and feature."""
from __future__ import annotations

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.torch.attention import paged_attention_torch


class TorchBackend(AttentionBackend):
    """`paged_attention_torch` over full-precision pools; codec caches dequantize first (no attend_packed)."""

    name = "torch"

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
               return_key_scores=False, rotate_keys=None, causal=True):
        return paged_attention_torch(q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale,
                                     return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal)


TORCH = TorchBackend()  # the model's and the caches' default
