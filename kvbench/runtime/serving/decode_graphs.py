"""Decode steps replayed from CUDA graphs: one captured forward per (batch-size bucket, table width).

    graphs = DecodeGraphs(model, cache, backend, method)           # capture: torch.cuda graphs, or a stand-in
    logits = graphs.run(tokens, plan)                               # [S, V], or None: run this step eagerly

As nano-vllm's `capture_cudagraph` (the design; the code is kvbench's own): the decode forward reads only static
buffers (tokens, query positions, write rows, block tables, lengths, key positions), which each step fills with
its own values before the graph replays, padded up to the bucket's batch size (padded rows: an empty table and
writes to the scratch block, so they read nothing and change no sequence). The graphs share one memory pool. A
bucket is captured the first time a step needs it; a step whose tables are wider than any capture so far gets a
wider capture (widths are powers of two), so capture counts stay logarithmic in the context.

Hooks: a graph cannot call the method between layers (its hooks decide on the host). So each layer's queries
and per-key attention mass are copied into static buffers during the replay, and after it the method's
`after_attention` runs for every layer in order, with the same LayerContext the eager step gives. The result is
the eager step's: a layer's hook changes only that layer's tables, which no later layer of the step reads.

Runs eagerly instead (`run` returns None, or `supported` says why not): keys cached before RoPE (rotated as read:
StreamingLLM's re-indexing, KVQuant), a step whose positions pass the RoPE table, batches above the largest
bucket. `capture` is how a graph is made: `cuda_capture` on a GPU; `cpu_standin_capture` elsewhere (tests): it
runs the step's function once under a host-sync counter and fails on any sync, as a real capture would, and its
"replay" re-runs that function on the static buffers, the same reads and writes that a replay issues.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvbench.runtime.cache.kv_cache import SCRATCH_BLOCK, AppendPlan
from kvbench.runtime.cache.kv_meter import DecodeReads
from kvbench.runtime.hooks import LayerContext, NoCompression, declared
from kvbench.runtime.model.forward import LlamaFamilyModel, RaggedGroup
from kvbench.runtime.serving.host_sync import HostSyncCounter

Capture = Callable[[Callable[[], None], Any], Callable[[], None]]


def default_buckets(max_batch: int) -> list[int]:
    """nano-vllm's batch buckets: 1, 2, 4, 8, then every 16 up to max_batch."""
    out = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    return out if out and out[-1] >= max_batch else out + [max_batch]


def cuda_capture(fn: Callable[[], None], pool: Any) -> Callable[[], None]:
    """Capture fn's kernels into a torch.cuda.CUDAGraph (after a warm-up run on a side stream); returns replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class HostSyncInCapture(RuntimeError):
    """A captured decode step read a device value on the host (a CUDA graph cannot hold that)."""


def cpu_standin_capture(fn: Callable[[], None], pool: Any) -> Callable[[], None]:
    """A stand-in for cuda_capture off the GPU: fn runs once under a HostSyncCounter (a sync fails, as it would
    break a real capture); the replay runs fn again over the same static buffers."""
    with HostSyncCounter() as syncs:
        fn()
    if syncs.count:
        raise HostSyncInCapture(f"host syncs inside the captured decode step: {syncs.calls}")
    return fn


class _Recorder(NoCompression):
    """The hook the captured forward calls: copies each layer's q and key scores into static buffers."""

    acts_after_attention = True

    def __init__(self, method: NoCompression, q_buf: torch.Tensor, ks_buf: torch.Tensor | None):
        self.needs_key_scores = bool(method.needs_key_scores)
        self.q_buf, self.ks_buf = q_buf, ks_buf  # [L, B, Hq, 1, D], [L, B, H, W*bs]

    def after_attention(self, ctx: LayerContext) -> None:
        self.q_buf[ctx.layer].copy_(ctx.q)
        if self.ks_buf is not None:
            self.ks_buf[ctx.layer].copy_(ctx.key_scores)


@dataclass
class _Graph:
    """One capture: its static buffers and its replay."""

    batch: int
    width: int  # table columns
    tokens: torch.Tensor  # [B, 1] int64
    plan: AppendPlan  # static tensors, [B, ...]
    logits: torch.Tensor  # [B, V]
    q: torch.Tensor  # [L, B, Hq, 1, D]
    key_scores: torch.Tensor | None  # [L, B, H, W*bs]
    replay: Callable[[], None] | None = None


class DecodeGraphs:
    """Captured decode forwards of one engine (module docstring)."""

    def __init__(self, model: LlamaFamilyModel, cache, backend, method, *, rope_mode: str = "original",
                 capture: Capture | None = None, max_batch: int = 256, buckets: list[int] | None = None):
        method = declared(method)
        self.model, self.cache, self.backend, self.method, self.rope_mode = model, cache, backend, method, rope_mode
        on_cuda = model.device.type == "cuda"
        self.capture = capture or (cuda_capture if on_cuda else cpu_standin_capture)
        self.buckets = sorted(buckets or default_buckets(max_batch))
        self.pool = torch.cuda.graph_pool_handle() if on_cuda and self.capture is cuda_capture else None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.hook = method if method.acts_after_attention else None
        self.replays = 0  # decode steps run from a graph
        self.eager_steps = 0  # decode steps run eagerly (run returned None)
        # a graph holds the RoPE table's memory: a step past its end runs eagerly, and if that grows the table
        # every graph is captured again
        self._rope_table = model.rotary.cos

    def supported(self) -> str | None:
        """None when decode steps may run from graphs, else why not."""
        if self.cache.store_pre_rope:
            return "keys cached before RoPE are rotated as they are read (host-dependent shapes)"
        if getattr(self.cache, "page_retrieval", None) is not None:
            return "page retrieval (its blocks read are counted per step, on the host)"
        if self.hook is not None and self.hook.reads_hidden_states:
            return "the method reads each layer's attention input (kept by no captured graph)"
        if not self.model.config.plain:
            return "the model has per-layer attention variants (windows, sinks, soft-capping) or a non-Llama layer"
        return None

    def run(self, tokens: torch.Tensor, plan: AppendPlan) -> torch.Tensor | None:
        """Logits [S, V] of the decode step (tokens [S, 1], plan from cache.prepare_append), hooks called; None
        when this step runs eagerly."""
        S = tokens.shape[0]
        if self.model.rotary.cos is not self._rope_table:  # the table grew (an eager step): captures are stale
            self.graphs.clear()
            self._rope_table = self.model.rotary.cos
        if (self.supported() is not None or S > self.buckets[-1] or plan.max_position is None
                or plan.max_position >= self._rope_table.shape[0]):
            self.eager_steps += 1
            return None
        batch = next(b for b in self.buckets if b >= S)
        nb = plan.tables.shape[-1]
        width = max(8, 1 << (nb - 1).bit_length())
        g = self.graphs.get((batch, width))
        if g is None:
            reads, self.cache.decode_reads = self.cache.decode_reads, DecodeReads()  # the capture's pass: not a step
            try:
                g = self._capture(batch, width)
            finally:
                self.cache.decode_reads = reads
        self._fill(g, tokens, plan)
        g.replay()
        self.replays += 1
        self._count_reads(plan)
        if self.hook is not None:
            for li in range(self.cache.num_layers):
                ks = g.key_scores[li, :S] if g.key_scores is not None else None
                self.hook.after_attention(LayerContext(li, self.cache, plan, "decode", True, g.q[li, :S], ks,
                                                       self.model.rotary))
        return g.logits[:S].clone()  # the static buffer is overwritten by the next replay

    # ------------------------------------------------------------------ internals
    def _count_reads(self, plan: AppendPlan) -> None:
        """The replayed step's decode reads (kv_meter.DecodeReads; the captured forward counts only at capture):
        every block of every table, against uncompressed caches of the tokens seen."""
        c = self.cache
        c.decode_reads.step(len(plan.slot_list), c.uncompressed_read_bytes(plan.slot_list))
        c.decode_reads.read(c.decode_read_bytes(plan, list(range(c.num_layers))))

    def _fill(self, g: _Graph, tokens: torch.Tensor, plan: AppendPlan) -> None:
        """Copy this step's inputs into the graph's static buffers; padded rows read nothing (length 0) and write
        to the scratch block."""
        S, nb = tokens.shape[0], plan.tables.shape[-1]
        bs = self.cache.block_size
        sp = g.plan
        g.tokens[:S].copy_(tokens)
        g.tokens[S:].zero_()
        sp.query_positions[:S].copy_(plan.query_positions)
        sp.query_positions[S:].zero_()
        sp.write_index[:S].copy_(plan.write_index)
        sp.write_index[S:].fill_(SCRATCH_BLOCK * bs)
        sp.tables[:S, :, :, :nb].copy_(plan.tables)
        sp.tables[:S, :, :, nb:].fill_(SCRATCH_BLOCK)
        sp.tables[S:].fill_(SCRATCH_BLOCK)
        sp.lengths[:S].copy_(plan.lengths)
        sp.lengths[S:].zero_()
        sp.positions[:S, :, :, : nb * bs].copy_(plan.positions)
        sp.positions[:S, :, :, nb * bs:].fill_(-1)
        sp.positions[S:].fill_(-1)

    def _capture(self, batch: int, width: int) -> _Graph:
        c, cfg, dev = self.cache, self.model.config, self.model.device
        L, H, bs = c.num_layers, c.num_kv_heads, c.block_size
        plan = AppendPlan(
            slots=torch.zeros(batch, dtype=torch.int64, device=dev),
            write_index=torch.full((batch, L, H, 1), SCRATCH_BLOCK * bs, dtype=torch.int64, device=dev),
            tables=torch.full((batch, L, H, width), SCRATCH_BLOCK, dtype=torch.int32, device=dev),
            lengths=torch.zeros(batch, L, H, dtype=torch.int64, device=dev),
            query_positions=torch.zeros(batch, 1, dtype=torch.int64, device=dev),
            key_positions=torch.full((batch, L, H, width * bs), -1, dtype=torch.int32, device=dev),
            slot_list=[],
            max_position=0,  # the table is never grown inside (sized up front)
        )
        tokens = torch.zeros(batch, 1, dtype=torch.int64, device=dev)
        logits = torch.zeros(batch, cfg.vocab_size, dtype=self.model.dtype, device=dev)
        q = torch.zeros(L, batch, cfg.num_heads, 1, cfg.head_dim, dtype=self.model.dtype, device=dev)
        needs_ks = self.hook is not None and self.method.needs_key_scores
        ks = torch.zeros(L, batch, H, width * bs, dtype=torch.float32, device=dev) if needs_ks else None
        recorder = _Recorder(self.method, q, ks) if self.hook is not None else None
        group = RaggedGroup(tokens, plan, "decode", True)
        model, cache, backend, rope_mode = self.model, self.cache, self.backend, self.rope_mode

        def step() -> None:
            out = model.forward_ragged([group], cache, backend=backend, hook=recorder, logits_for="last",
                                       rope_mode=rope_mode)[0]
            logits.copy_(out)

        g = _Graph(batch, width, tokens, plan, logits, q, ks)
        g.replay = self.capture(step, self.pool)
        self.graphs[(batch, width)] = g
        return g
