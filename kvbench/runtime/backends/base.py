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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class DecodeWeights:
    """What a fused decode step reads of the model (runtime.model.forward.LlamaFamilyModel.decode_weights): its
    dimensions and each layer's weights, not the model. Built once per model; `fuse` is read at each step."""

    num_layers: int
    num_heads: int  # Hq
    num_kv_heads: int  # H
    head_dim: int  # D
    hidden_size: int  # E
    intermediate_size: int  # I
    rms_norm_eps: float
    layers: list  # per layer: ln_attn [E], qkv E -> (Hq + 2H) D, o, ln_mlp [E], gate_up E -> 2I, down (Linear)
    fuse: bool = True  # the model allows whole layers per call (its fuse_decode_layers, C kernels, no q/k norm)
    kernel_form: Any = field(default=None, repr=False)  # the backend's own form of `layers`, built on first use


@dataclass(eq=False)
class DecodePools:
    """What a fused decode step reads of the cache (runtime.cache.kv_cache.PagedKVCache.decode_pools): its pools,
    their layout, and the page summaries a retrieval method keeps, not the cache."""

    k_pool: "torch.Tensor"  # [N, block_size, D] (a codec cache: its full-precision blocks)
    v_pool: "torch.Tensor"
    block_size: int
    head_dim: int
    num_kv_heads: int
    dtype: Any  # the cache's dtype
    plain: bool  # plain pools (no codec)
    store_pre_rope: bool
    kv_block_bytes: int  # bytes of one block of K and V (reads counted)
    summaries: Any = None  # a retrieval method's BlockSummaries (.summary [N, 2, D], .bytes_per_block) or None
    codec: Any = None  # a codec cache's codec, its packed pools and the dtype of its full-precision blocks
    kq_pool: Optional["torch.Tensor"] = None  # [n_packed, key bytes] uint8
    vq_pool: Optional["torch.Tensor"] = None
    fp_dtype: Any = None


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
    fuses_decode: bool = False  # has a fused decode step (`fused_decode` may return one)

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

    def fused_decode(self, weights: DecodeWeights, tokens, pools: DecodePools, plan, rope_mode: str, cos, sin,
                     need_scores: bool, retrieval=None) -> Optional[FusedDecode]:
        """A FusedDecode for this step (tokens [S, 1]; cos, sin [S, 1, D] of the new tokens) over the model's
        `weights` and the cache's `pools` (narrow views), or None: the model runs the layers op by op.
        `retrieval`: the method's kvbench.runtime.cache.page_retrieval.PageRetrieval (the step reads only the
        selected blocks of its layers) or None."""
        return None
