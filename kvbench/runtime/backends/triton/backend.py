"""The Triton backend: the paged-attention kernel on CUDA (keys cached after RoPE; every step: decode, chunked
prefill, scoring). Imported only when chosen (backends/selection.py, through triton.load)."""
from __future__ import annotations

import torch

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.triton.attention import paged_attention_triton


class TritonBackend(AttentionBackend):
    """`paged_attention_triton` over full-precision pools (its key scores cover every slot of the tables)."""

    name = "triton"

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
               return_key_scores=False, rotate_keys=None, causal=True):
        res = paged_attention_triton(q, k_pool, v_pool, tables, lengths.to(torch.int32), key_positions,
                                     query_positions.to(torch.int32), scale, return_key_scores=return_key_scores)
        return res if return_key_scores else (res, None)
