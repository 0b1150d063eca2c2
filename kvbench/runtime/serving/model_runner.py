"""The model runner: one forward step of the model over the paged cache, with the method's hooks.

    runner = ModelRunner(model, cache, backend, method, meter)
    logits = runner.run(segments)                   # one ragged step: [V] per segment (its last token's)
    logits = runner.forward(slots, tokens [S, Q], positions [S, Q], phase=..., last_chunk=..., logits_for=...)

`run` takes a step's segments (kvbench.runtime.serving.batch: a prefill chunk or a decode token each), plans where
their tokens go in the cache (cache.prepare_append(s) -> AppendPlan) and runs the model once: a pure-decode step as
the plain decode step (a captured graph when the engine uses them, else the fused CPU path or the eager forward),
any other as `LlamaFamilyModel.forward_ragged` over groups of equal-length segments. `forward` is one rectangular
step, for the engine's chunk and decode API. Both keep the engine's KV figures (its KVMeter) current.
"""
from __future__ import annotations

from typing import Any

import torch

from kvbench.runtime.cache.kv_meter import KVMeter
from kvbench.runtime.hooks import NoCompression
from kvbench.runtime.model.forward import LlamaFamilyModel, RaggedGroup
from kvbench.runtime.serving.batch import Segment
from kvbench.runtime.serving.decode_graphs import DecodeGraphs


class ModelRunner:
    """Runs `model` over `cache` with `backend`'s kernels and `method`'s hooks; see the module docstring."""

    def __init__(self, model: LlamaFamilyModel, cache: Any, backend: Any, method: NoCompression, meter: KVMeter):
        self.model, self.cache, self.backend, self.method, self.meter = model, cache, backend, method, meter
        # methods that never act after attention (full, pure codecs) are not called once per layer
        self.layer_hook = method if method.acts_after_attention else None
        self.decode_graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs (Engine.use_decode_graphs)

    @torch.no_grad()
    def forward(self, slots: list[int], tokens: torch.Tensor, positions: torch.Tensor, *, phase: str,
                last_chunk: bool, logits_for: str, scratch: bool = False,
                max_position: int | None = None) -> torch.Tensor | None:
        plan = self.cache.prepare_append(slots, positions)
        plan.max_position = max_position  # known on the host: RoPE's table needs no device read
        logits = None
        if self.decode_graphs is not None and phase == "decode" and logits_for == "last" and tokens.shape[1] == 1:
            logits = self.decode_graphs.run(tokens, plan)  # None: this step runs eagerly
        if logits is None:
            logits = self.model.forward(
                tokens, self.cache, plan, backend=self.backend, hook=self.layer_hook, phase=phase,
                last_chunk=last_chunk, logits_for=logits_for, rope_mode=self.method.rope_mode,
            )
        if scratch:  # a method's own pass: its tokens are not the sequence's (nor in the uncompressed figure)
            for s in slots:
                self.cache.tokens_seen[s] -= tokens.shape[1]
        if not self.cache.has_pending_frees():  # else tracked once the sampled tokens bring the evicted ids
            self.meter.track()
        return logits

    @torch.no_grad()
    def run(self, segments: list[Segment], logits_for: str = "last") -> list[torch.Tensor]:
        """One ragged step: every segment's tokens in one forward (vLLM v1's flattened batch); returns the logits
        [V] of each segment's last token (logits_for="all": [n, V], every token's: speculative verification). A
        pure-decode step is the plain decode step (the fused CPU path); otherwise the segments are grouped by length
        (all decode tokens together, each prefill chunk length together) and `LlamaFamilyModel.forward_ragged` runs
        the groups' tokens as one flat batch.
        Blocks are allocated group by group: the caller makes sure they fit (an OutOfBlocksError part-way leaves
        the earlier groups' sequences appended but not computed: the scheduler preempts them all)."""
        if not segments:
            return []
        dev = self.model.device
        if all(s.phase == "decode" and len(s.token_ids) == 1 for s in segments):
            toks = torch.tensor([s.token_ids for s in segments], dtype=torch.int64, device=dev)  # [S, 1]
            qpos = torch.tensor([[s.start_pos] for s in segments], dtype=torch.int64, device=dev)  # [S, 1]
            logits = self.forward([s.slot for s in segments], toks, qpos, phase="decode", last_chunk=True,
                                  logits_for="last", max_position=max(s.start_pos for s in segments))
            return list(logits) if logits_for == "last" else [row[None] for row in logits]
        by_shape: dict[tuple, list[int]] = {}  # (phase, length, last_chunk) -> segment indices, first-seen order
        for i, s in enumerate(segments):
            by_shape.setdefault((s.phase, len(s.token_ids), s.last_chunk), []).append(i)
        toks, room, order = [], [], []
        for (phase, n, last), idx in by_shape.items():
            toks.append(torch.tensor([segments[i].token_ids for i in idx], dtype=torch.int64, device=dev))  # [S_g, n]
            qpos = torch.tensor([[segments[i].start_pos + j for j in range(n)] for i in idx], dtype=torch.int64,
                                device=dev)  # [S_g, n]
            room.append(([segments[i].slot for i in idx], qpos))
            order += idx
        plans = self.cache.prepare_appends(room)
        for plan, (_, n, _), idx in zip(plans, by_shape, by_shape.values()):
            plan.max_position = max(segments[i].start_pos for i in idx) + n - 1
        groups = [RaggedGroup(t, plan, phase, last) for t, plan, (phase, _, last) in zip(toks, plans, by_shape)]
        out = self.model.forward_ragged(groups, self.cache, backend=self.backend, hook=self.layer_hook,
                                        logits_for=logits_for, rope_mode=self.method.rope_mode)
        self.meter.track()
        rows = torch.cat(out) if logits_for == "last" else [r for part in out for r in part]  # in group order
        result: list[torch.Tensor] = [None] * len(segments)  # type: ignore[list-item]
        for r, i in enumerate(order):
            result[i] = rows[r]
        self._after_prefill_chunks(segments)
        return result

    def _after_prefill_chunks(self, segments: list[Segment]) -> None:
        """The method's `after_prefill_chunk` hook for each prefill segment of a step (as forward_chunk)."""
        prefill = [s for s in segments if s.phase == "prefill"]
        for s in prefill:
            self.method.after_prefill_chunk(s.slot, list(s.token_ids), s.start_pos, s.last_chunk)
        if prefill and not self.cache.has_pending_frees():  # what the hook evicted (KVzip's): held_kv_bytes sees it
            self.meter.track(after_method_hook=True)
