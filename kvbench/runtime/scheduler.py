"""Continuous batching over one paged pool (the manner of nano-vllm and vLLM), with preemption by recompute.

    sched = Scheduler(engine, max_num_seqs=256, max_num_batched_tokens=2048, admission_watermark=0.01)
    outcome = sched.run([Request(prompt_ids, max_new_tokens=128), ...])

Queues: `waiting` (arrived, not admitted, FIFO; a preempted request goes back to its head) and `admitted` (in
admission order: sequences still prefilling and sequences decoding). Each step is one forward over a rectangular
batch, so a step is either
  - a prefill step: one chunk (<= prefill_chunk_size and max_num_batched_tokens tokens) of the oldest admitted
    sequence that is still prefilling, or of the waiting head, which is admitted when the pool has free blocks
    for that chunk plus a reserve (admission_watermark x the pool) and fewer than max_num_seqs are admitted; or
  - a decode step: one token for every decoding sequence (at most max_num_batched_tokens of them).
Prefill steps come first when one can run (nano-vllm's order): the model's forward takes a rectangular
[S, Q] batch, so mixing prefill chunks and decode tokens in one step (vLLM v1's ragged batch) would pad every
decode row to the chunk's length.
When a decode step cannot get its blocks, the most recently admitted sequence is preempted by recompute: its
blocks go back to the pool at once, the method forgets it (on_sequence_end), and its prompt plus the tokens it
generated return to the head of the waiting queue; re-admitted, it is prefilled again (the method compresses it
as any prompt) and goes on from its last token. A preempted request is re-admitted only once the pool has room for
the blocks it held (no thrashing). A sequence that cannot get blocks while it is the only one admitted can never
fit: it fails alone with a message naming its size and the pool's, and the others go on.
Methods evict inside the engine's steps as they always do, and the blocks they free are reused at once.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from kvbench.runtime.block_pool import OutOfBlocksError


@dataclass
class Request:
    """One generation request and, once run, its outcome and timings (seconds on the scheduler's clock)."""

    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # when it may be admitted (0 = at the start)
    ignore_eos: bool = False  # generate exactly max_new_tokens (throughput traces)
    index: int = 0  # position in the submitted list
    # outcome
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | prefilling | decoding | finished | failed
    finish_reason: str = ""  # stop | length | failed
    error: Optional[str] = None
    first_token_s: Optional[float] = None
    finish_s: Optional[float] = None
    prefill_tokens: int = 0  # tokens prefilled (recomputation after preemption included)
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    preemptions: int = 0
    # scheduling state
    slot: Optional[int] = None
    fed: int = 0  # tokens of prompt + output already in the cache
    resume_blocks: int = 0  # blocks held when last preempted (needed free before re-admission)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class StepRecord:
    """One scheduler step, for the timeline."""

    t_s: float
    kind: str  # prefill | decode
    running: int  # admitted sequences after the step
    waiting: int  # arrived, not admitted
    blocks_in_use: int
    tokens: int  # tokens in the step's forward


@dataclass
class Outcome:
    requests: list[Request]
    timeline: list[StepRecord]
    preemptions: int
    wall_s: float
    max_running: int


class Scheduler:
    """Runs requests to completion over the engine's pool; see the module docstring."""

    def __init__(self, engine: Any, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 admission_watermark: float = 0.01, chunk_size: Optional[int] = None,
                 stop_token_ids: Iterable[int] = (), temperature: float = 0.0, top_p: float = 1.0,
                 seed: Optional[int] = None,
                 should_stop: Optional[Callable[[int, list[int]], bool]] = None,
                 on_token: Optional[Callable[[Request], None]] = None,
                 clock: Callable[[], float] = time.perf_counter):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or not 0 <= admission_watermark < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, admission_watermark in [0, 1)")
        self.engine, self.cache = engine, engine.cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunk = min(chunk_size or engine.prefill_chunk_size, max_num_batched_tokens)
        self.reserve = int(admission_watermark * self.cache.capacity_blocks())
        self.stops = {int(t) for t in stop_token_ids}
        self.temperature, self.top_p, self.should_stop, self.on_token = temperature, top_p, should_stop, on_token
        self.gen = torch.Generator(device="cpu")
        if seed is not None:
            self.gen.manual_seed(seed)
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.admitted: list[Request] = []  # admission order
        self.timeline: list[StepRecord] = []
        self.preemptions = 0
        self._decode_start = 0

    # ------------------------------------------------------------------ driver
    def run(self, requests: list[Request]) -> Outcome:
        """Run every request to completion (or failure); returns them with their timings and the timeline."""
        for i, r in enumerate(requests):
            r.index = i
            if not r.prompt:
                raise ValueError("empty prompt")
            if r.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {r.max_new_tokens}")
        pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        self.t0 = self.clock()
        self.max_running = 0
        try:
            while pending or self.waiting or self.admitted:
                now = self.now()
                while pending and pending[0].arrival_s <= now:
                    r = pending.popleft()
                    if r.max_new_tokens == 0:
                        self._finish(r, "length")
                    else:
                        self.waiting.append(r)
                if not self.waiting and not self.admitted:
                    if pending:  # idle until the next arrival
                        time.sleep(max(0.0, pending[0].arrival_s - self.now()))
                    continue
                if not self._prefill_step():
                    self._decode_step()
        except BaseException:
            for r in list(self.admitted):
                self._release(r)
            raise
        return Outcome(requests, self.timeline, self.preemptions, self.now(), self.max_running)

    def now(self) -> float:
        return self.clock() - self.t0

    # ------------------------------------------------------------------ prefill
    def _prefill_step(self) -> bool:
        """Run one prefill chunk if one can run now; False if none can."""
        req = next((r for r in self.admitted if r.status == "prefilling"), None)
        if req is not None:
            n = min(self.chunk, len(req.tokens) - req.fed)
            if self.cache.blocks_for_append([req.slot], n) > self.cache.free_blocks():
                if len(self.admitted) == 1:
                    self._fail_too_large(req)
                    return True
                return False  # decode steps free blocks (sequences finish) or preempt
        else:
            if not self.waiting or len(self.admitted) >= self.max_num_seqs:
                return False
            req = self.waiting[0]
            n = min(self.chunk, len(req.tokens))
            first = self.cache.blocks_for_append([None], n)
            if first > self.cache.capacity_blocks():  # not even an empty pool holds its first chunk
                self.waiting.popleft()
                self._fail_too_large(req)
                return True
            # with nothing admitted, nothing else could free the reserve: admit if the chunk fits
            need = first if not self.admitted else max(first, req.resume_blocks) + self.reserve
            if need > self.cache.free_blocks():
                return False
            self.waiting.popleft()
            req.slot = self.cache.add_sequence()
            req.status = "prefilling"
            req.fed = 0
            self.admitted.append(req)
            self.max_running = max(self.max_running, len(self.admitted))
        ids = req.tokens
        a, b = req.fed, req.fed + n
        last = b == len(ids)
        t0 = self.clock()
        try:
            logits = self.engine.forward_chunk(req.slot, ids[a:b], a, last_chunk=last,
                                               logits_for="last" if last else "none")
        except OutOfBlocksError:
            self._preempt(req)
            return True
        req.fed = b
        req.prefill_tokens += n
        if last:
            tok = self.engine.sample(logits, self.temperature, self.top_p, self.gen)[0]
            _sync(self.engine)
            req.prefill_s += self.clock() - t0
            req.status = "decoding"
            self._emit(req, tok)
        else:
            _sync(self.engine)
            req.prefill_s += self.clock() - t0
        self._record("prefill", n)
        return True

    # ------------------------------------------------------------------ decode
    def _decode_step(self) -> None:
        while True:
            batch = [r for r in self.admitted if r.status == "decoding"]
            if not batch:
                if self.admitted:  # only a prefilling sequence that cannot get blocks
                    self._preempt_newest()
                return
            if len(batch) > self.max_num_batched_tokens:  # rotate so every sequence advances
                k = self._decode_start % len(batch)
                batch = (batch[k:] + batch[:k])[: self.max_num_batched_tokens]
                self._decode_start += self.max_num_batched_tokens
            need = self.cache.blocks_for_append([r.slot for r in batch], 1)
            if need <= self.cache.free_blocks():
                break
            self._preempt_newest()
        t0 = self.clock()
        try:
            new = self.engine.decode_batch([r.slot for r in batch], [r.output[-1] for r in batch],
                                           [len(r.tokens) - 1 for r in batch], self.temperature, self.top_p,
                                           self.gen)
        except OutOfBlocksError:
            self._preempt_newest()
            return
        _sync(self.engine)
        dt = self.clock() - t0
        for r, tok in zip(batch, new):
            r.fed += 1
            r.decode_s += dt
            r.decode_tokens += 1
            self._emit(r, tok)
        self._record("decode", len(batch))

    # ------------------------------------------------------------------ helpers
    def _emit(self, r: Request, tok: int) -> None:
        r.output.append(int(tok))
        if r.first_token_s is None:
            r.first_token_s = self.now()
        if self.on_token is not None:
            self.on_token(r)
        if not r.ignore_eos and (int(tok) in self.stops or (
                self.should_stop is not None and self.should_stop(r.index, r.output))):
            self._finish(r, "stop")
        elif len(r.output) >= r.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str) -> None:
        self._release(r)
        r.status = "failed" if reason == "failed" else "finished"
        r.finish_reason = reason
        r.finish_s = self.now()

    def _release(self, r: Request) -> None:
        if r.slot is not None:
            self.engine.end_sequence(r.slot)
            r.slot = None
        if r in self.admitted:
            self.admitted.remove(r)

    def _preempt_newest(self) -> None:
        victim = self.admitted[-1]
        if len(self.admitted) == 1:
            self._fail_too_large(victim)
        else:
            self._preempt(victim)

    def _preempt(self, r: Request) -> None:
        """Preemption by recompute: free the blocks now; prompt + generated tokens back to the waiting head."""
        held = self.cache.blocks_held(r.slot) if r.slot is not None else 0
        self._release(r)
        r.status, r.fed, r.resume_blocks = "waiting", 0, held
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def _fail_too_large(self, r: Request) -> None:
        n = len(r.tokens)
        need = self.cache.blocks_for_append([None], n)
        r.error = (f"request {r.index} does not fit: its {n} tokens need {need} KV blocks, the whole pool holds "
                   f"{self.cache.capacity_blocks()} ({self.cache.pool_bytes()} bytes); raise runtime.kv_memory_bytes "
                   "or use a method that evicts during prefill")
        self._finish(r, "failed")

    def _record(self, kind: str, tokens: int) -> None:
        self.timeline.append(StepRecord(self.now(), kind, len(self.admitted), len(self.waiting),
                                        self.cache.blocks_in_use_now(), tokens))


def _sync(engine: Any) -> None:
    dev = engine.model.device
    if getattr(dev, "type", "cpu") == "cuda":
        torch.cuda.synchronize(dev)
