"""Continuous batching over one paged pool (the manner of nano-vllm and vLLM v1), with preemption.

    sched = Scheduler(cache, engine.end_sequence, chunk_size=512, max_num_seqs=256, max_num_batched_tokens=2048)
    sched.add([Request(prompt_ids, max_new_tokens=128), ...])
    while sched.has_unfinished():
        batch = sched.schedule()                  # what to run: [Scheduled(request, n tokens, kind), ...]
        ...                                       # the engine runs it (Engine.serve) and samples
        sched.postprocess(batch, sampled, dt)     # {index in batch: token}: emit, finish, record
    outcome = sched.outcome()

Each step is schedule -> run -> postprocess: `schedule()` returns what to run (a list of `Scheduled` segments: a
prefill chunk or one decode token of a sequence), the engine runs them as one ragged forward (`Engine.step`) and
samples, and `postprocess` advances the requests, emits the tokens, finishes and records. The scheduler never runs
the model: it sees the cache (block counts and sequences) and a callback that ends a sequence.

Queues: `pending` (submitted, not arrived yet), `waiting` (arrived, not admitted, FIFO; a preempted request goes
back to its head) and `admitted` (in admission order: sequences still prefilling and sequences decoding). The two
policies that fill a step from them (`runtime.schedule`: mixed, prefill_first) are in `policies.py`; the requests
and steps are in `requests.py`.
A request is admitted when the pool has free blocks for its first chunk plus a reserve (admission_watermark x the
pool) and fewer than max_num_seqs are admitted. With a prefix cache (`prefix_cache.PrefixCache`), a newly admitted
request first takes the cached blocks of its prompt's longest cached prefix and prefills only the rest.
A request with `fork_of` (a live sequence holding its prompt's first `fork_tokens` tokens: a context compressed once)
is admitted as a copy-on-write fork of that sequence (the `fork` callable, Engine.fork_sequence) and prefills only the
rest; its admission counts the copies of the shared, partly filled last blocks its first chunk makes.
When the decode tokens of a step cannot get their blocks, the most recently admitted sequence is preempted
(`preemption.py`: by recompute, or by swapping its blocks to host memory) and goes back to the waiting head; a
swapped-out request at the head comes back before any new admission. A sequence that cannot get blocks while it is
the only one admitted can never fit: it fails alone with a message naming its size and the pool's, and the others
go on. Methods evict inside the engine's steps as they always do, and the blocks they free are reused at once.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable, Optional

from kvbench.runtime.serving.policies import POLICIES
from kvbench.runtime.serving.preemption import Preemptor
from kvbench.runtime.serving.requests import Outcome, Request, Scheduled, StepRecord
from kvbench.run.spec import SCHEDULES

__all__ = ["Outcome", "Request", "Scheduled", "Scheduler", "StepRecord"]


class Scheduler:
    """Queues, admission and preemption over one cache's pool; see the module docstring. `end_sequence(slot)` ends
    a sequence (the engine's: the method forgets it, its blocks go back to the pool)."""

    def __init__(self, cache: Any, end_sequence: Callable[[int], None], *, chunk_size: int,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, admission_watermark: float = 0.01,
                 stop_token_ids: Iterable[int] = (),
                 should_stop: Optional[Callable[[int, list[int]], bool]] = None,
                 on_token: Optional[Callable[[Request], None]] = None,
                 clock: Callable[[], float] = time.perf_counter,
                 schedule: str = "mixed", prefix_cache: Any = None, lookahead: int = 1, swap: Any = None,
                 preemption: str = "recompute", on_swap_out: Optional[Callable[[int], None]] = None,
                 fork: Optional[Callable[[int], int]] = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or not 0 <= admission_watermark < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, admission_watermark in [0, 1)")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        self.cache, self.end_sequence = cache, end_sequence
        self.fork = fork  # fork(slot) -> a copy-on-write child (Engine.fork_sequence): admits Request.fork_of
        self.forked_prompt_tokens = 0
        # a decode step appends up to `lookahead` tokens per sequence (speculative decoding: k drafts + 1)
        self.lookahead = int(lookahead)
        self.preemptor = Preemptor(cache, end_sequence, mode=preemption, swap=swap, on_swap_out=on_swap_out)
        self.admitted_prompt_tokens = 0
        self.schedule_policy, self.prefix_cache = schedule, prefix_cache
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.chunk = min(chunk_size, max_num_batched_tokens)
        self.reserve = int(admission_watermark * self.cache.capacity_blocks())
        self.stops = {int(t) for t in stop_token_ids}
        self.should_stop, self.on_token = should_stop, on_token
        self.clock = clock
        self.requests: list[Request] = []
        self.pending: deque[Request] = deque()  # submitted, not arrived yet (arrival order)
        self.waiting: deque[Request] = deque()
        self.admitted: list[Request] = []  # admission order
        self.timeline: list[StepRecord] = []
        self.cached_prompt_tokens = 0
        self.max_running = 0
        self._decode_start = 0
        self.t0 = self.clock()

    # ------------------------------------------------------------------ driver
    def add(self, requests: list[Request]) -> None:
        """Submit the requests (all at once; each is admitted once it has arrived); the clock starts now."""
        for i, r in enumerate(requests):
            r.index = i
            if not r.prompt:
                raise ValueError("empty prompt")
            if r.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {r.max_new_tokens}")
            if r.fork_of is not None:
                if self.fork is None:
                    raise ValueError("Request.fork_of needs a scheduler with a fork callable (Engine.serve gives one)")
                if r.fork_of not in self.cache.live:
                    raise ValueError(f"Request.fork_of={r.fork_of}: no such live sequence")
                if not 0 < r.fork_tokens < len(r.prompt):
                    raise ValueError(f"Request.fork_tokens={r.fork_tokens} must be in [1, {len(r.prompt) - 1}]: "
                                     "the forked sequence holds a prefix of the prompt, and at least its last "
                                     "token is computed (for its logits)")
        self.requests = requests
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        self.t0 = self.clock()
        self.max_running = 0

    def has_unfinished(self) -> bool:
        """Whether any request is still to arrive, waiting or admitted."""
        return bool(self.pending or self.waiting or self.admitted)

    def outcome(self) -> Outcome:
        """The requests with their outputs and timings, and the timeline."""
        pre = self.preemptor
        return Outcome(self.requests, self.timeline, pre.preemptions, self.now(), self.max_running,
                       self.cached_prompt_tokens, self.admitted_prompt_tokens, pre.swap_preemptions, pre.swap_stats(),
                       self.forked_prompt_tokens)

    def release_all(self) -> None:
        """End every admitted sequence (the run stopped on an error)."""
        for r in list(self.admitted):
            self._release(r)
        for r in self.waiting:
            if r.swapped_status is not None:
                self.preemptor.drop_swapped(r)

    def now(self) -> float:
        return self.clock() - self.t0

    def _arrive(self) -> bool:
        """Move the requests that have arrived to the waiting queue (finishing those that want no tokens); when
        nothing is waiting or admitted, sleep until the next arrival. Whether there is anything to schedule."""
        now = self.now()
        while self.pending and self.pending[0].arrival_s <= now:
            r = self.pending.popleft()
            if r.max_new_tokens == 0:
                self._finish(r, "length")
            else:
                self.waiting.append(r)
        if not self.waiting and not self.admitted:
            if self.pending:  # idle until the next arrival
                time.sleep(max(0.0, self.pending[0].arrival_s - self.now()))
            return False
        return True

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> list[Scheduled]:
        """What the next step runs, after taking in the requests that arrived (empty when nothing can run now: this
        call only waited for an arrival, or preempted or failed requests)."""
        if not self._arrive():
            return []
        self._swap_in_waiting()
        return POLICIES[self.schedule_policy](self)

    def _swap_in_waiting(self) -> None:
        """Bring swapped-out requests at the waiting head back (before any new admission) while their blocks fit
        with the reserve (and a decode step's room) and fewer than max_num_seqs run."""
        while self.waiting and self.waiting[0].swapped_status is not None and len(self.admitted) < self.max_num_seqs:
            c = self.cache  # beside other sequences, the reserve and a decode step's blocks stay free
            room = self.reserve + self.lookahead * c.num_layers * c.num_kv_heads if self.admitted else 0
            if not self.preemptor.swap_in(self.waiting[0], room):
                return
            self._enter(self.waiting.popleft())

    def admit(self, budget: int, free: int, whole_prompt: bool = False,
              inflight: Optional[set] = None) -> Optional[Scheduled]:
        """Admit the waiting head for its first chunk (<= budget tokens) if it fits in `free` blocks with the
        reserve (whole_prompt: its whole uncached prompt must fit, so admitted prompts never push each other
        out mid-prefill); None otherwise. With a prefix cache, a head whose next uncached block is one that this
        step computes for another request (`inflight` keys) waits a step and takes it from the cache then."""
        if not self.waiting or len(self.admitted) >= self.max_num_seqs or self.waiting[0].swapped_status:
            return None
        req = self.waiting[0]
        if req.fork_of is not None:
            return self._admit_fork(req, budget, free, whole_prompt)
        cached = revived = 0
        if self.prefix_cache is not None:
            found = self.prefix_cache.lookup(req.tokens[:req.compressed_end])  # never past the compressed part
            n_cached = len(found)
            cached = n_cached * self.cache.block_size
            revived = self.prefix_cache.cached_free_blocks(found)  # cached blocks no sequence holds: they count
            # as free now and stop counting once attached
            if inflight and (n_cached + 1) * self.cache.block_size < len(req.tokens):
                if self.prefix_cache.block_keys(req.tokens, n_cached + 1)[-1] in inflight:
                    return None
        n = min(self.chunk, budget, req.prefill_stop(cached) - cached)
        first = self.cache.blocks_for_append([None], n)
        if first > self.cache.capacity_blocks():  # not even an empty pool holds its first chunk
            self.waiting.popleft()
            self.fail_too_large(req)
            return None
        # with nothing admitted, nothing else could free the reserve: admit if the chunk fits
        want = self.cache.blocks_for_append([None], len(req.tokens) - cached) if whole_prompt else first
        # a preempted request waits for room for the blocks it held (no thrashing); its own cached blocks count
        need = first + revived if not self.admitted else max(want + revived, req.resume_blocks) + self.reserve
        if need > free:
            return None
        self.waiting.popleft()
        self.admitted_prompt_tokens += len(req.tokens)
        req.slot = self.cache.add_sequence()
        req.status = "prefilling"
        req.fed = req.registered_blocks = req.cached_tokens = 0
        if self.prefix_cache is not None:
            req.cached_tokens = self.prefix_cache.attach(req.slot, req.tokens[:req.compressed_end])
            req.fed = req.cached_tokens
            req.registered_blocks = req.cached_tokens // self.cache.block_size
            self.cached_prompt_tokens += req.cached_tokens
            n = min(n, req.prefill_stop(req.fed) - req.fed)
        self._enter(req)
        return Scheduled(req, n, "prefill", revived)

    def _admit_fork(self, req: Request, budget: int, free: int, whole_prompt: bool) -> Optional[Scheduled]:
        """Admit the waiting head `req` (Request.fork_of) as a copy-on-write fork of its live sequence, for its
        first chunk after the forked prefix; None when the chunk (whole_prompt: the whole rest of its prompt) and
        the copies of the shared, partly filled last blocks (one per such table) do not fit in `free` blocks with
        the reserve."""
        parent, fed = req.fork_of, req.fork_tokens
        n = min(self.chunk, budget, req.prefill_stop(fed) - fed)
        c = self.cache
        copies = int((c.host_lengths[parent] % c.block_size != 0).sum())  # the fork's first append copies them
        first = c.blocks_for_append([parent], n) + copies
        if first > free and not self.admitted:  # nothing admitted could free room for it
            self.waiting.popleft()
            self.fail_too_large(req)
            return None
        want = c.blocks_for_append([parent], len(req.tokens) - fed) + copies if whole_prompt else first
        need = first if not self.admitted else max(want, req.resume_blocks) + self.reserve
        if need > free:
            return None
        self.waiting.popleft()
        self.admitted_prompt_tokens += len(req.tokens)
        self.forked_prompt_tokens += fed
        req.slot = self.fork(parent)
        req.status = "prefilling"
        req.fed, req.cached_tokens = fed, 0
        req.registered_blocks = fed // c.block_size  # the parent's blocks are not offered again
        self._enter(req)
        return Scheduled(req, n, "prefill", copies=copies)

    def decode_batch(self, budget: int) -> Optional[list[Request]]:
        """One decode token for each decoding sequence (rotated when more than `budget`), preempting the newest
        admitted sequences until their blocks fit; None when that left nothing to schedule this step."""
        while True:
            batch = [r for r in self.admitted if r.status == "decoding"]
            if not batch:
                return batch
            if len(batch) > budget:  # rotate so every sequence advances
                k = self._decode_start % len(batch)
                batch = (batch[k:] + batch[:k])[:budget]
                self._decode_start += budget
            need = self.cache.blocks_for_append([r.slot for r in batch], self.lookahead)
            if need <= self.cache.free_blocks():
                return batch
            if len(self.admitted) == 1:
                self.fail_too_large(self.admitted[0])
                return None
            self.preempt_newest()

    def preempt_newest(self) -> None:
        """Preempt the most recently admitted sequence; alone, it can never fit and fails."""
        victim = self.admitted[-1]
        if len(self.admitted) == 1:
            self.fail_too_large(victim)
        else:
            self._preempt(victim)

    def fail_too_large(self, r: Request) -> None:
        """Finish r as failed: the pool cannot hold it (the error names its size and the pool's)."""
        n = len(r.tokens)
        need = self.cache.blocks_for_append([None], n)
        r.error = (f"request {r.index} does not fit: its {n} tokens need {need} KV blocks, the whole pool holds "
                   f"{self.cache.capacity_blocks()} ({self.cache.pool_bytes()} bytes); raise runtime.kv_memory_bytes "
                   "or use a method that evicts during prefill")
        self._finish(r, "failed")

    # ------------------------------------------------------------------ postprocess
    def undo_step(self, batch: list[Scheduled]) -> None:
        """The engine ran out of blocks part-way through this step (some of its sequences may have appended):
        every sequence in it starts over (recompute), newest first; one alone that cannot fit fails."""
        for sc in sorted(batch, key=lambda sc: -self.admitted.index(sc.req)):
            if len(self.admitted) == 1:
                self.fail_too_large(sc.req)
            else:
                self._preempt(sc.req, swap=False)  # its tables hold tokens appended but not computed

    def postprocess(self, batch: list[Scheduled], sampled: dict[int, int], dt: float) -> None:
        """After the engine ran `batch` in dt seconds and sampled {index in batch: token} for the segments that emit:
        advance each request by its scheduled tokens, emit the sampled ones, offer newly full blocks to the
        prefix cache, record the step. A prefill chunk is charged its share of the step's time by tokens (so the
        prefill time of a trace sums to the time its prompt tokens took); a decode token the whole step (the
        latency its sequence saw)."""
        total = sum(sc.n for sc in batch)
        kinds = {sc.kind for sc in batch}
        emitted = 0
        for i, sc in enumerate(batch):
            r = sc.req
            toks = sampled.get(i)
            toks = [] if toks is None else (list(toks) if isinstance(toks, (list, tuple)) else [toks])
            # a speculative decode emits several tokens: all but the last are in the cache now
            r.fed += sc.n + max(0, len(toks) - 1) if sc.kind == "decode" else sc.n
            if sc.kind == "decode":
                r.decode_s += dt
                r.decode_tokens += max(1, len(toks))
            else:
                r.prefill_tokens += sc.n
                r.prefill_s += dt * sc.n / total
                self.preemptor.note_prefill(sc.n, dt * sc.n / total)
            if self.prefix_cache is not None and r.slot is not None:
                cached = r.tokens if len(toks) <= 1 else r.tokens + toks[:-1]  # the tokens in the cache now
                r.registered_blocks = self.prefix_cache.register(r.slot, cached, r.fed, r.registered_blocks)
            if toks and r.status == "prefilling":
                r.status = "decoding"
            for tok in toks:
                if r.status != "decoding":
                    break  # finished (stop token or length) part-way through a speculative round
                emitted += 1
                self._emit(r, tok)
        self._record(kinds.pop() if len(kinds) == 1 else "mixed", total, emitted)

    # ------------------------------------------------------------------ helpers
    def _enter(self, r: Request) -> None:
        """r joins the admitted sequences (newest last)."""
        self.admitted.append(r)
        self.max_running = max(self.max_running, len(self.admitted))

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
            self.end_sequence(r.slot)
            r.slot = None
        if r in self.admitted:
            self.admitted.remove(r)

    def _preempt(self, r: Request, swap: bool = True) -> None:
        """Take r's blocks back (recompute, or swap when `swap` allows and the preemption mode says so) and put r
        at the waiting head."""
        self.preemptor.preempt(r, swap)
        if r in self.admitted:
            self.admitted.remove(r)
        self.waiting.appendleft(r)

    def _record(self, kind: str, tokens: int, emitted: int = 0) -> None:
        out_bytes, in_bytes = self.preemptor.bytes_moved()
        self.timeline.append(StepRecord(self.now(), kind, len(self.admitted), len(self.waiting),
                                        self.cache.blocks_in_use_now(), tokens, emitted, self.preemptor.preemptions,
                                        out_bytes, in_bytes))
