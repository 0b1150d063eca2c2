"""Decode steps on CPU in one C call for all layers (csrc/decode_layer.c) instead of about ten calls per layer.

Why: a small model's batch-1 decode step spends much of its time outside the weight GEMVs, in per-op overhead
(Python, torch dispatch, and one OpenMP parallel region per op whose sleeping worker thread must be woken each
time). The fused path runs norms, projections, RoPE, the K/V write, paged attention and the MLP of every layer in
one parallel region; with a method's hook it makes one call per layer and calls the hook after each.

It applies to decode steps (one token per sequence, at most `kernels.GEMV_MAX_ROWS` sequences) of an fp32 model on
CPU with the C kernels whose projections are each a Linear with its plain [out, in] fp32 copy (the C GEMV) or a
QuantLinear, a GGUF file's blocks kept quantized (`model.weights=quantized`; up to `kernels.MAX_PARTS` stacked
matrices, each in its own type, multiplied inside the step's region by the kernels the op-by-op path calls, with the
same activations, fp32 or q8: `quant_linear.quant_matmul_team_address`), a cache with plain pools
(`PagedKVCache.plain_pools`) or a codec cache whose packed blocks the C codec decode kernel reads
(`CpuBackend.block_formats`: KIVI, int8; new tokens land in its full-precision pools, fp16 or fp32, and packing
happens before the step, in `prepare_append`), keys cached after RoPE at their original positions, no q/k norm
(Qwen3), under the CPU backend (`CpuBackend.fused_decode`). Anything else, or `model.fuse_decode_layers = False`,
takes the op-by-op path; both give the same numbers up to the last bits of the C silu against torch's
(tests/runtime/test_fused_decode.py).
The hook gets the same LayerContext as on the op-by-op path, but after the layer's MLP instead of before its output
projection, which changes nothing: hooks read q and the attention scores and edit the cache, which that layer no
longer reads. A hook that reads only the cache in decode steps (`decode_reads_attention = False`) is called for
each layer after the whole step, which then stays one call (runtime.model.step_hooks).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable

import torch

from kvbench.runtime.backends.base import DecodePools, DecodeWeights, FusedDecode
from kvbench.runtime.backends.cpu import kernels, quant_linear

if TYPE_CHECKING:  # annotations only: the backends sit below the cache that plans the step
    from kvbench.runtime.cache.append_plan import AppendPlan


def projection(lin) -> kernels.Projection | None:
    """The C kernel's view of one projection: a QuantLinear's blocks (each stacked part in its own type), or a
    Linear's plain [out, in] fp32 copy; None when it has neither (see linear.Linear) or more parts than the kernel
    takes."""
    parts = getattr(lin, "parts", None)  # a QuantLinear (duck-typed: a profiler may wrap it)
    if parts is not None:
        if len(parts) > kernels.MAX_PARTS or any(p.cols != lin.in_features for p in parts):
            return None
        return kernels.Projection.quantized([(p.type_id, p.data) for p in parts], quant_linear.ISAS[lin.isa],
                                            lin.bias, quant_linear.ACTIVATIONS[lin.activations])
    plain = getattr(lin, "_plain", None)
    return kernels.Projection.fp32(plain, lin.bias) if plain is not None else None


def layer_weights(weights: DecodeWeights) -> ctypes.Array | None:
    """The C kernel's view of every layer's weights (built once per model, kept on `weights`; the model's Linears
    keep the tensors alive), or None when a projection has no form the kernel reads (`projection`)."""
    cached = weights.kernel_form
    if cached is not None:
        return cached or None
    rows = []
    for lw in weights.layers:
        projs = [projection(lin) for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        if any(p is None for p in projs):
            weights.kernel_form = []
            return None
        rows.append(kernels.DecodeLayerWeights.of(lw.ln_attn, lw.ln_mlp, *projs))
    if any(proj.part[0].type != 0 for row in rows for proj in (row.qkv, row.o, row.gu, row.down)):
        kernels.set_quant_matmul(quant_linear.quant_matmul_team_address())
    weights.kernel_form = (kernels.DecodeLayerWeights * len(rows))(*rows)
    return weights.kernel_form


class FusedDecodeStep(FusedDecode):
    """One decode step's shared state for `decode_layers`: RoPE rows, write rows, scratch buffers sized for the
    step's longest table."""

    def __init__(self, weights: DecodeWeights, layers: ctypes.Array, pools: DecodePools, plan: AppendPlan,
                 cos: torch.Tensor, sin: torch.Tensor, need_scores: bool, formats: tuple | None = None,
                 retrieval=None):
        S = plan.lengths.shape[0]
        H, D = weights.num_kv_heads, weights.head_dim
        self.shape, self.layers, self.pools, self.plan = weights, layers, pools, plan
        self.cos, self.sin = cos.reshape(S, D).contiguous(), sin.reshape(S, D).contiguous()  # [S, D]
        self.write_rows = plan.write_index[..., 0].transpose(0, 1).contiguous()  # [L, S, H]
        # work items in whole blocks over a codec cache, as codec_decode_attention_cpu splits them (same partials)
        min_chunk = 16 if formats is None else pools.block_size
        self.buffers = kernels._DecodeBuffers(S, H, weights.num_heads // H, D, int(plan.lengths.max()), min_chunk,
                                              False)
        self.codec = None if formats is None else kernels.CodecPools.of(pools, formats, self.buffers.threads)
        I = weights.intermediate_size
        self.scratch = (torch.empty(S, weights.hidden_size), torch.empty(S, I), torch.empty(S, 2 * I))  # h, act, gu
        self.need_scores = need_scores
        self.scale = D ** -0.5
        self.pages = None  # page retrieval (kvbench.runtime.cache.page_retrieval): summaries and selection in C
        self.per_head = retrieval is not None and retrieval.per_head
        if retrieval is not None:
            L = weights.num_layers
            self.page_counts = [retrieval.pages_for(li) for li in range(L)]
            self.retrieving_layers = [li for li, n in enumerate(self.page_counts) if n]
            self.pages = kernels.PageSelect.of(pools.summaries.summary, self.page_counts, S, H, weights.num_heads // H,
                                               D, plan.tables.shape[-1], pools.block_size, self.buffers.threads,
                                               retrieval.per_head)

    def _layers(self, x: torch.Tensor, first: int, n: int) -> torch.Tensor:
        w, plan = self.shape, self.plan
        return kernels.decode_layers(
            x, self.layers, first, n, w.intermediate_size, w.rms_norm_eps, self.cos, self.sin,
            self.pools.k_pool, self.pools.v_pool, self.write_rows, plan.tables, plan.lengths, w.num_heads,
            self.scale, self.buffers, self.scratch, self.codec, self.pages)

    def run(self, x: torch.Tensor, after_layer: Callable[[int, torch.Tensor, torch.Tensor | None], None] | None
            ) -> None:
        """Every layer on x [S, E] in place. Without `after_layer`, all of them in one call; with it, one call per
        layer followed by after_layer(layer, q [S, Hq, 1, D], key_scores [S, H, T_layer] or None)."""
        L = self.shape.num_layers
        if after_layer is None:
            self._layers(x, 0, L)
            return
        b, S = self.buffers, x.shape[0]
        for li in range(L):
            if self.need_scores:  # fresh per layer: the method's hook may keep it
                b.key_scores = torch.empty(S, self.shape.num_kv_heads, b.Tp, dtype=torch.float32)
            q = self._layers(x, li, 1)
            key_scores = None
            if self.need_scores:
                t_layer = max(max(self.plan.table_lengths(i, li)) for i in range(S))
                key_scores = b.key_scores[:, :, :t_layer]
            after_layer(li, q, key_scores)

    def count_reads(self, reads) -> None:
        """The K/V bytes its retrieving layers' selections held (kv_meter.DecodeReads; the model counts the layers
        that read every block)."""
        if self.pages is None:
            return
        p = self.pools
        bs = p.block_size
        layers = self.retrieving_layers
        held = self.plan.host_lengths_array()[:, layers]  # [S, n, H] of the retrieving layers
        sel = self.pages.selected_lengths[layers]  # [n, S, H] (per_head: [n, S, Hq])
        # one sum over every retrieving layer: a per-layer loop of small numpy / torch ops costs a step measurably
        reads.scored(int(((held + bs - 1) // bs).sum()) * p.summaries.bytes_per_block)
        if self.per_head:  # a block two query heads of a kv-head read is read once
            reads.read(int(self.pages.kv_head_blocks[layers].sum()) * p.kv_block_bytes)
        else:
            reads.read(int(((sel + bs - 1) // bs).sum()) * p.kv_block_bytes)


def fused_decode_step(weights: DecodeWeights, tokens: torch.Tensor, pools: DecodePools, plan: AppendPlan,
                      rope_mode: str, cos: torch.Tensor, sin: torch.Tensor, need_scores: bool,
                      formats: tuple | None = None, retrieval=None) -> FusedDecodeStep | None:
    """A FusedDecodeStep when this step can run fused (see the module docstring), else None. `formats`: the (key,
    value) kernels.BlockFormat of a codec cache's packed rows (None: a plain cache, or one the kernels cannot
    read)."""
    S, Q = tokens.shape
    k, v = pools.k_pool, pools.v_pool
    if not (weights.fuse and Q == 1 and S <= kernels.GEMV_MAX_ROWS and not torch.is_grad_enabled()
            and not pools.store_pre_rope and rope_mode == "original"
            and (pools.plain or formats is not None)
            and (k.dtype == torch.float32 or (formats is not None and k.dtype == torch.float16))
            and v.dtype == k.dtype and k.is_contiguous() and v.is_contiguous()
            and weights.num_heads // weights.num_kv_heads <= kernels._MAX_GROUP):
        return None
    if retrieval is not None and (formats is not None or need_scores or pools.summaries is None):
        return None  # page retrieval runs fused over plain pools, without per-key attention mass
    layers = layer_weights(weights)
    if layers is None:
        return None
    return FusedDecodeStep(weights, layers, pools, plan, cos, sin, need_scores, formats, retrieval)
