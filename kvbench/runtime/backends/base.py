"""The interface between the runtime core and its attention backends.

One backend object per engine. The model calls `fused_decode` once per decode step (before running the layers op
by op); the caches call `attend` over a layer's full-precision pool, and a codec's cache calls `attend_packed`
first (its packed blocks read in place) and falls back to dequantizing into a dense scratch plus `attend`.

Shapes (one layer): q [S, Hq, Q, D]; k_pool, v_pool [num_blocks, block_size, D]; tables [S, H, MB] int32 (block ids
per (sequence, kv-head) table); lengths [S, H] int64; key_positions [S, H, MB * block_size] int32 (original
position of each slot); query_positions [S, Q] int64. Query i sees the cached keys at positions <= its own
(causal=False: every key, as in plain decoding). Results: (out [S, Hq, Q, D], key_scores [S, H, T] or None), the
attention mass each key slot received, summed over the query heads of its kv-head and the queries; T covers the
longest table (a decode step's scores cover the tables' whole width, MB * block_size, zero past each length, so
that no shape depends on a length's value).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch


class FusedDecode:
    """A decode step that runs whole decoder layers per kernel call (x updated in place)."""

    def run(self, x: "torch.Tensor", after_layer: Optional[Callable[[int, Any, Any], None]]) -> None:
        """Every layer on x [S, E]; after_layer(layer, q [S, Hq, 1, D], key_scores [S, H, T] or None) after each
        (then one call per layer), or None (all layers in one call)."""
        raise NotImplementedError

    def count_reads(self, reads) -> None:
        """Add what this step's retrieving layers read to `reads` (kvbench.runtime.cache.kv_meter.DecodeReads), after
        `run` (the model counts the layers that read every block)."""


class AttentionBackend:
    """What the core calls. `attend` is required; the other two return None where a backend has no such kernel."""

    name: str = "?"  # "torch" | "cpu" | "triton": what Engine.attention_backend reports

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale: float, *,
               return_key_scores: bool = False, rotate_keys: Optional[Callable] = None, causal: bool = True):
        """Paged attention over one layer's pool (shapes in the module docstring). rotate_keys(k [S, H, T, D],
        positions [S, H, T]) -> k rotates keys stored before RoPE as they are read."""
        raise NotImplementedError

    def attend_packed(self, cache, layer: int, q, plan, scale: float, *, return_key_scores: bool = False,
                      rotate_keys: Optional[Callable] = None, causal: bool = True):
        """Attention over a codec cache's layer read in place from both its pools (full-precision blocks in
        cache.k_pool / v_pool, packed rows in cache.kq_pool / vq_pool, laid out as cache.codec.affine_rows says),
        or None: the cache then dequantizes and calls `attend`."""
        return None

    def fused_decode(self, model, tokens, cache, plan, rope_mode: str, cos, sin,
                     need_scores: bool, retrieval=None) -> Optional[FusedDecode]:
        """A FusedDecode for this step (tokens [S, 1]; cos, sin [S, 1, D] of the new tokens), or None: the model
        runs the layers op by op. `retrieval`: the method's kvbench.runtime.cache.page_retrieval.PageRetrieval (the
        step reads only the selected blocks of its layers) or None."""
        return None
