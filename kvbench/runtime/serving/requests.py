"""The data the scheduler and the engine share: a request (what to generate, then its outcome and timings), one
request's share of a step (`Scheduled`), one step's record for the timeline (`StepRecord`) and a served trace's
outcome (`Outcome`).

A request with `fork_of` starts from a copy-on-write fork of a live sequence that holds its first `fork_tokens`
prompt tokens (the multi-request protocol: one compressed context, many questions), instead of an empty one.

A request with an `uncompressed_tail` (a question after its context, kvpress's query-agnostic protocol) is prefilled
in two parts that no chunk crosses: the context, whose last chunk lets the method compress, then the tail (and, after
a recompute, the tokens generated so far) in chunks the method keeps uncompressed (`Scheduled.compress`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Request:
    """One generation request and, once run, its outcome and timings (seconds on the scheduler's clock)."""

    prompt: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # when it may be admitted (0 = at the start)
    ignore_eos: bool = False  # generate exactly max_new_tokens (throughput traces)
    # the last n prompt tokens (a question) go in uncompressed after the rest (its context) was compressed
    uncompressed_tail: int = 0
    # the last n tokens of the compressed part (the prompt but its uncompressed tail) are its question, compressed with
    # the context (query-aware): a method that needs the question's extent (Finch's window) is told through its
    # optional question_tokens(slot, n) hook; a tail after it (kvpress: the turn's end, the answer prefix) is appended
    # uncompressed once it was compressed
    question_tokens: int = 0
    # a live sequence whose cache holds this request's first fork_tokens prompt tokens (a context prefilled and
    # compressed once): admission forks it copy-on-write (Engine.fork_sequence) and prefills only the rest; it
    # must stay live until the request finishes (a request preempted by recompute forks it again)
    fork_of: Optional[int] = None
    fork_tokens: int = 0
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
class Scheduled:
    """One request's share of a step: n tokens from req.fed on (a prefill chunk, or its decode token)."""

    req: Request
    n: int
    kind: str  # prefill | decode
    revived: int = 0  # cached free blocks its admission took back from the pool (prefix cache)
    copies: int = 0  # blocks its chunk copies first (a fork's shared, partly filled last blocks: copy-on-write)

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
    """A served trace: the requests with their outputs and timings, the step timeline and the run's counters."""

    requests: list[Request]
    timeline: list[StepRecord]
    preemptions: int
    wall_s: float
    max_running: int
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    admitted_prompt_tokens: int = 0  # prompt tokens of every admission (the prefix cache's lookups)
    swap_preemptions: int = 0  # of the preemptions, those that swapped the blocks out (the rest recomputed)
    swap: dict = field(default_factory=dict)  # the swap space's counters (SwapSpace.stats), when there is one
    forked_prompt_tokens: int = 0  # prompt tokens that admissions took from a forked sequence (Request.fork_of)
