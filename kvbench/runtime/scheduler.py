"""Continuous batching over one paged pool (the manner of nano-vllm and vLLM v1), with preemption by recompute.

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
the model: it sees the cache (blocks and sequences) and a callback that ends a sequence.

Queues: `waiting` (arrived, not admitted, FIFO; a preempted request goes back to its head) and `admitted` (in
admission order: sequences still prefilling and sequences decoding). Two policies (`schedule`):
  - "mixed" (default; vLLM v1's): every step first takes one decode token of each running decoding sequence, then
    prefill chunks (<= prefill_chunk_size tokens each) of admitted sequences still prefilling, then of newly
    admitted requests, until max_num_batched_tokens tokens are in the step. Decodes never wait for a prompt.
  - "prefill_first" (nano-vllm's; kvbench's earlier policy, kept to reproduce its figures): a step is either one
    prefill chunk (of the oldest prefilling sequence, else of the waiting head) or, when none can run, one decode
    token for every decoding sequence.
A request is admitted when the pool has free blocks for its first chunk plus a reserve (admission_watermark x the
pool) and fewer than max_num_seqs are admitted. With a prefix cache (`prefix_cache.PrefixCache`), a newly admitted
request first takes the cached blocks of its prompt's longest cached prefix and prefills only the rest.
When the decode tokens of a step cannot get their blocks, the most recently admitted sequence is preempted by
recompute: its blocks go back to the pool at once, the method forgets it (on_sequence_end), and its prompt plus the
tokens it generated return to the head of the waiting queue; re-admitted, it is prefilled again (the method
compresses it as any prompt) and goes on from its last token. A preempted request is re-admitted only once the pool
has room for the blocks it held (no thrashing). A sequence that cannot get blocks while it is the only one admitted
can never fit: it fails alone with a message naming its size and the pool's, and the others go on.
A request with an `uncompressed_tail` (a question after its context, kvpress's query-agnostic protocol) is prefilled
in two parts that no chunk crosses: the context, whose last chunk lets the method compress, then the tail (and, after
a recompute, the tokens generated so far) in chunks the method keeps uncompressed (`Scheduled.compress`).
Methods evict inside the engine's steps as they always do, and the blocks they free are reused at once.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from kvbench.runtime.block_pool import OutOfBlocksError
from kvbench.runtime.swap import should_swap
from kvbench.spec import SCHEDULES


@dataclass
class Request:
    """One generation request and, once run, its outcome and timings (seconds on the scheduler's clock)."""

    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # when it may be admitted (0 = at the start)
    ignore_eos: bool = False  # generate exactly max_new_tokens (throughput traces)
    # the last n prompt tokens (a question) go in uncompressed after the rest (its context) was compressed
    uncompressed_tail: int = 0
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
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (last admission)
    registered_blocks: int = 0  # leading full blocks offered to the prefix cache
    swapped_status: Optional[str] = None  # the status it had when swapped out (None: not swapped out)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def compressed_end(self) -> int:
        """Where the part the method compresses as a prompt ends: every token without an uncompressed tail; else
        the prompt but its tail (at least one token), the tail and the tokens generated so far going in
        uncompressed after it (so a request preempted by recompute is prefilled again the same way)."""
        if self.uncompressed_tail <= 0:
            return len(self.tokens)
        return len(self.prompt) - min(self.uncompressed_tail, len(self.prompt) - 1)

    def prefill_stop(self, pos: int) -> int:
        """Where a prefill chunk from token `pos` must end at the latest: a chunk never crosses the end of the
        compressed part."""
        end = self.compressed_end
        return end if pos < end else len(self.tokens)


@dataclass
class StepRecord:
    """One scheduler step, for the timeline."""

    t_s: float
    kind: str  # prefill | decode | mixed
    running: int  # admitted sequences after the step
    waiting: int  # arrived, not admitted
    blocks_in_use: int
    tokens: int  # tokens in the step's forward
    emitted: int = 0  # tokens the step emitted (more than its decodes with speculative decoding)
    preemptions: int = 0  # preemptions so far (both kinds)
    swap_out_bytes: int = 0  # bytes swapped out so far
    swap_in_bytes: int = 0  # bytes swapped in so far


@dataclass
class Outcome:
    requests: list[Request]
    timeline: list[StepRecord]
    preemptions: int
    wall_s: float
    max_running: int
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    admitted_prompt_tokens: int = 0  # prompt tokens of every admission (the prefix cache's lookups)
    swap_preemptions: int = 0  # of the preemptions, those that swapped the blocks out (the rest recomputed)
    swap: dict = field(default_factory=dict)  # the swap space's counters (SwapSpace.stats), when there is one


@dataclass
class Scheduled:
    """One request's share of a step: n tokens from req.fed on (a prefill chunk, or its decode token)."""

    req: Request
    n: int
    kind: str  # prefill | decode
    revived: int = 0  # cached free blocks its admission took back from the pool (prefix cache)

    @property
    def emits(self) -> bool:
        """Whether the step's logits for it give the request's next token (its last prompt chunk, a decode)."""
        return self.req.fed + self.n == len(self.req.tokens)

    @property
    def compress(self) -> bool:
        """False for a chunk of the request's uncompressed tail (the method keeps its tokens)."""
        return self.kind == "decode" or self.req.fed < self.req.compressed_end

    @property
    def last_chunk(self) -> bool:
        """Whether the method may compress after this chunk: the end of the compressed part (the prompt's last
        chunk, without a tail), every chunk of an uncompressed tail, a decode token."""
        return self.emits or not self.compress or self.req.fed + self.n == self.req.compressed_end


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
                 preemption: str = "recompute", on_swap_out: Optional[Callable[[int], None]] = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or not 0 <= admission_watermark < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, admission_watermark in [0, 1)")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        self.cache, self.end_sequence = cache, end_sequence
        # a decode step appends up to `lookahead` tokens per sequence (speculative decoding: k drafts + 1)
        self.lookahead = int(lookahead)
        self.swap, self.preemption, self.on_swap_out = swap, preemption, on_swap_out
        if preemption != "recompute" and swap is None:
            raise ValueError(f"preemption={preemption!r} needs a swap space")
        self.swap_preemptions = 0
        self.admitted_prompt_tokens = 0
        self._prefill_tokens, self._prefill_s = 0, 0.0  # measured so far (the auto preemption rule)
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
        self.preemptions = 0
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
        self.requests = requests
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.index)))
        self.t0 = self.clock()
        self.max_running = 0

    def has_unfinished(self) -> bool:
        """Whether any request is still to arrive, waiting or admitted."""
        return bool(self.pending or self.waiting or self.admitted)

    def outcome(self) -> Outcome:
        """The requests with their outputs and timings, and the timeline."""
        return Outcome(self.requests, self.timeline, self.preemptions, self.now(), self.max_running,
                       self.cached_prompt_tokens, self.admitted_prompt_tokens, self.swap_preemptions,
                       self.swap.stats() if self.swap is not None else {})

    def release_all(self) -> None:
        """End every admitted sequence (the run stopped on an error)."""
        for r in list(self.admitted):
            self._release(r)
        for r in self.waiting:
            if r.swapped_status is not None:
                self._drop_swapped(r)

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
        if self.schedule_policy == "prefill_first":
            return self._schedule_prefill_first()
        return self._schedule_mixed()

    def _schedule_mixed(self) -> list[Scheduled]:
        """Decodes first, then prefill chunks of admitted and newly admitted requests within the token budget."""
        self._swap_in_waiting()
        budget = self.max_num_batched_tokens
        decodes = self._decode_batch(budget)
        if decodes is None:
            return []
        out = [Scheduled(r, 1, "decode") for r in decodes]
        budget -= len(out)
        free = self.cache.free_blocks() - (self.cache.blocks_for_append([r.slot for r in decodes], self.lookahead)
                                           if decodes else 0)
        blocked = False
        debt = 0  # blocks the prompts admitted so far still need after this step (admission leaves them room)
        inflight: set = set()  # prefix-cache keys of the blocks this step's prefill chunks complete
        for r in [r for r in self.admitted if r.status == "prefilling"]:
            if budget <= 0:
                break
            n = min(self.chunk, budget, r.prefill_stop(r.fed) - r.fed)
            need = self.cache.blocks_for_append([r.slot], n)
            if need > free:
                if len(self.admitted) == 1:
                    self._fail_too_large(r)
                    return []
                blocked = True  # in order: a later prompt does not overtake an earlier one
                break
            out.append(Scheduled(r, n, "prefill"))
            free -= need
            budget -= n
            debt += self.cache.blocks_for_append([r.slot], len(r.tokens) - r.fed) - need
            self._note_inflight(r, n, inflight)
        while budget > 0 and not blocked:
            seg = self._admit(budget, free - debt, whole_prompt=True, inflight=inflight)
            if seg is None:
                break
            out.append(seg)
            r = seg.req
            need = self.cache.blocks_for_append([r.slot], seg.n)
            free -= need + seg.revived
            budget -= seg.n
            debt += self.cache.blocks_for_append([r.slot], len(r.tokens) - r.fed) - need
            self._note_inflight(r, seg.n, inflight)
        if not out and self.admitted:  # only prefilling sequences that cannot get blocks
            self._preempt_newest()
        return out

    def _note_inflight(self, r: Request, n: int, inflight: set) -> None:
        """Add the prefix-cache keys of the full blocks that r's chunk of n tokens completes to `inflight`."""
        if self.prefix_cache is None:
            return
        bs = self.cache.block_size
        first, last = r.fed // bs, (r.fed + n) // bs
        if last > first:
            inflight.update(self.prefix_cache.block_keys(r.tokens, last)[first:])

    def _admit(self, budget: int, free: int, whole_prompt: bool = False,
               inflight: Optional[set] = None) -> Optional[Scheduled]:
        """Admit the waiting head for its first chunk (<= budget tokens) if it fits in `free` blocks with the
        reserve (whole_prompt: its whole uncached prompt must fit, so admitted prompts never push each other
        out mid-prefill); None otherwise. With a prefix cache, a head whose next uncached block is one that this
        step computes for another request (`inflight` keys) waits a step and takes it from the cache then."""
        if not self.waiting or len(self.admitted) >= self.max_num_seqs or self.waiting[0].swapped_status:
            return None
        req = self.waiting[0]
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
            self._fail_too_large(req)
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
        self.admitted.append(req)
        self.max_running = max(self.max_running, len(self.admitted))
        return Scheduled(req, n, "prefill", revived)

    def _decode_batch(self, budget: int) -> Optional[list[Request]]:
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
                self._fail_too_large(self.admitted[0])
                return None
            self._preempt_newest()

    def _schedule_prefill_first(self) -> list[Scheduled]:
        """One prefill chunk if one can run (the oldest prefilling sequence, else the waiting head); else every
        decoding sequence's next token."""
        self._swap_in_waiting()
        req = next((r for r in self.admitted if r.status == "prefilling"), None)
        if req is not None:
            n = min(self.chunk, req.prefill_stop(req.fed) - req.fed)
            if self.cache.blocks_for_append([req.slot], n) <= self.cache.free_blocks():
                return [Scheduled(req, n, "prefill")]
            if len(self.admitted) == 1:
                self._fail_too_large(req)
                return []
        else:
            seg = self._admit(self.max_num_batched_tokens, self.cache.free_blocks())
            if seg is not None:
                return [seg]
        batch = self._decode_batch(self.max_num_batched_tokens)
        if batch is None:
            return []
        if not batch:
            if self.admitted:  # only a prefilling sequence that cannot get blocks
                self._preempt_newest()
            return []
        return [Scheduled(r, 1, "decode") for r in batch]

    # ------------------------------------------------------------------ postprocess
    def undo_step(self, batch: list[Scheduled]) -> None:
        """The engine ran out of blocks part-way through this step (some of its sequences may have appended):
        every sequence in it starts over (recompute), newest first; one alone that cannot fit fails."""
        for sc in sorted(batch, key=lambda sc: -self.admitted.index(sc.req)):
            if len(self.admitted) == 1:
                self._fail_too_large(sc.req)
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
                self._prefill_tokens += sc.n
                self._prefill_s += dt * sc.n / total
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

    def _preempt_newest(self) -> None:
        victim = self.admitted[-1]
        if len(self.admitted) == 1:
            self._fail_too_large(victim)
        else:
            self._preempt(victim)

    def _preempt(self, r: Request, swap: bool = True) -> None:
        """Preemption: by swapping (runtime.preemption swap, or auto when it costs less) the blocks go to host memory
        and the request waits at the head with its slot; by recompute the blocks are freed now and prompt +
        generated tokens go back to the waiting head."""
        if swap and self._swap_out(r):
            return
        held = self.cache.blocks_held(r.slot) if r.slot is not None else 0
        self._release(r)
        r.status, r.fed, r.resume_blocks = "waiting", 0, held
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(r)

    def _swap_out(self, r: Request) -> bool:
        """Swap r's blocks out if the preemption policy says so and the swap space has room; whether it did."""
        if self.swap is None or r.slot is None or self.preemption == "recompute":
            return False
        held = self.swap.bytes_of(r.slot)
        rate = self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else None
        if not should_swap(self.preemption, held, r.fed, self.swap.bandwidth(), rate):
            return False
        if not self.swap.can_swap_out(r.slot):
            return False
        self.swap.swap_out(r.slot)
        if self.on_swap_out is not None:
            self.on_swap_out(r.slot)
        self.admitted.remove(r)
        r.swapped_status, r.status = r.status, "waiting"
        r.preemptions += 1
        self.preemptions += 1
        self.swap_preemptions += 1
        self.waiting.appendleft(r)
        return True

    def _swap_in_waiting(self) -> None:
        """Bring swapped-out requests at the waiting head back (before any new admission) while their blocks fit
        with the reserve (and a decode step's room) and fewer than max_num_seqs run."""
        while self.waiting and self.waiting[0].swapped_status is not None and len(self.admitted) < self.max_num_seqs:
            r = self.waiting[0]
            need = self.swap.blocks_to_swap_in(r.slot)
            if self.admitted:
                need += self.reserve + self.lookahead * self.cache.num_layers * self.cache.num_kv_heads
            if need > self.cache.free_blocks():
                return
            try:
                self.swap.swap_in(r.slot)
            except OutOfBlocksError:  # a codec's pool: its packed rows did not fit yet
                return
            self.waiting.popleft()
            r.status, r.swapped_status = r.swapped_status, None
            self.admitted.append(r)
            self.max_running = max(self.max_running, len(self.admitted))

    def _drop_swapped(self, r: Request) -> None:
        self.swap.discard(r.slot)
        self.end_sequence(r.slot)
        r.slot, r.swapped_status = None, None

    def _fail_too_large(self, r: Request) -> None:
        n = len(r.tokens)
        need = self.cache.blocks_for_append([None], n)
        r.error = (f"request {r.index} does not fit: its {n} tokens need {need} KV blocks, the whole pool holds "
                   f"{self.cache.capacity_blocks()} ({self.cache.pool_bytes()} bytes); raise runtime.kv_memory_bytes "
                   "or use a method that evicts during prefill")
        self._finish(r, "failed")

    def _record(self, kind: str, tokens: int, emitted: int = 0) -> None:
        sw = self.swap
        self.timeline.append(StepRecord(self.now(), kind, len(self.admitted), len(self.waiting),
                                        self.cache.blocks_in_use_now(), tokens, emitted, self.preemptions,
                                        sw.bytes_out if sw is not None else 0, sw.bytes_in if sw is not None else 0))
