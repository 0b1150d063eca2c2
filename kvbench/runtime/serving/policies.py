"""The two step policies (`runtime.schedule`): which prefill chunks and decode tokens one scheduler step runs.

  - "mixed" (default; vLLM v1's): every step first takes one decode token of each running decoding sequence, then
    prefill chunks (<= prefill_chunk_size tokens each) of admitted sequences still prefilling, then of newly
    admitted requests, until max_num_batched_tokens tokens are in the step. Decodes never wait for a prompt; a
    prompt is admitted only when its whole uncached prompt fits beside what the admitted prompts still need, so
    prompts prefilling together never push each other out.
  - "prefill_first" (nano-vllm's): a step is either one prefill chunk (of the oldest prefilling sequence, else of
    the waiting head, admitted for that chunk) or, when none can run, one decode token for every decoding sequence.
    Prompts prefill one at a time, and a decode token waits for every prompt chunk that can run.

Each policy is a function of the scheduler: it uses its queues and mechanisms (`Scheduler.admit`, `decode_batch`,
`preempt_newest`, `fail_too_large`) and returns the step's segments (empty when nothing can run this step). What a
policy reads of the scheduler is the `SchedulerView` protocol below, so this module does not import the scheduler
(which imports the policies).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from kvbench.runtime.serving.requests import Request, Scheduled


class SchedulerView(Protocol):
    """The members of kvbench.runtime.serving.scheduler.Scheduler a step policy reads and calls."""

    cache: Any  # the PagedKVCache (free_blocks, blocks_for_append, block_size)
    prefix_cache: Any  # the PrefixCache, or None
    admitted: list[Request]  # admission order
    chunk: int  # the most prompt tokens one prefill chunk takes
    lookahead: int  # tokens a decode step appends per sequence
    max_num_batched_tokens: int

    def admit(self, budget: int, free: int, whole_prompt: bool = False,
              inflight: Optional[set] = None) -> Optional[Scheduled]: ...

    def decode_batch(self, budget: int) -> Optional[list[Request]]: ...

    def preempt_newest(self) -> None: ...

    def fail_too_large(self, r: Request) -> None: ...


def schedule_mixed(s: SchedulerView) -> list[Scheduled]:
    """Decodes first, then prefill chunks of admitted and newly admitted requests within the token budget."""
    budget = s.max_num_batched_tokens
    decodes = s.decode_batch(budget)
    if decodes is None:
        return []
    out = [Scheduled(r, 1, "decode") for r in decodes]
    budget -= len(out)
    free = s.cache.free_blocks() - (s.cache.blocks_for_append([r.slot for r in decodes], s.lookahead)
                                    if decodes else 0)
    blocked = False
    debt = 0  # blocks the prompts admitted so far still need after this step (admission leaves them room)
    inflight: set = set()  # prefix-cache keys of the blocks this step's prefill chunks complete
    for r in [r for r in s.admitted if r.status == "prefilling"]:
        if budget <= 0:
            break
        n = min(s.chunk, budget, r.prefill_stop(r.fed) - r.fed)
        need = s.cache.blocks_for_append([r.slot], n)
        if need > free:
            if len(s.admitted) == 1:
                s.fail_too_large(r)
                return []
            blocked = True  # in order: a later prompt does not overtake an earlier one
            break
        out.append(Scheduled(r, n, "prefill"))
        free -= need
        budget -= n
        debt += s.cache.blocks_for_append([r.slot], len(r.tokens) - r.fed) - need
        _note_inflight(s, r, n, inflight)
    while budget > 0 and not blocked:
        seg = s.admit(budget, free - debt, whole_prompt=True, inflight=inflight)
        if seg is None:
            break
        out.append(seg)
        r = seg.req
        need = s.cache.blocks_for_append([r.slot], seg.n)
        free -= need + seg.revived + seg.copies
        budget -= seg.n
        debt += s.cache.blocks_for_append([r.slot], len(r.tokens) - r.fed) - need
        _note_inflight(s, r, seg.n, inflight)
    if not out and s.admitted:  # only prefilling sequences that cannot get blocks
        s.preempt_newest()
    return out


def _note_inflight(s: SchedulerView, r: Request, n: int, inflight: set) -> None:
    """Add the prefix-cache keys of the full blocks that r's chunk of n tokens completes to `inflight`."""
    if s.prefix_cache is None:
        return
    bs = s.cache.block_size
    first, last = r.fed // bs, (r.fed + n) // bs
    if last > first:
        inflight.update(s.prefix_cache.block_keys(r.tokens, last)[first:])


def schedule_prefill_first(s: SchedulerView) -> list[Scheduled]:
    """One prefill chunk if one can run (the oldest prefilling sequence, else the waiting head); else every
    decoding sequence's next token."""
    req = next((r for r in s.admitted if r.status == "prefilling"), None)
    if req is not None:
        n = min(s.chunk, req.prefill_stop(req.fed) - req.fed)
        if s.cache.blocks_for_append([req.slot], n) <= s.cache.free_blocks():
            return [Scheduled(req, n, "prefill")]
        if len(s.admitted) == 1:
            s.fail_too_large(req)
            return []
    else:
        seg = s.admit(s.max_num_batched_tokens, s.cache.free_blocks())
        if seg is not None:
            return [seg]
    batch = s.decode_batch(s.max_num_batched_tokens)
    if batch is None:
        return []
    if not batch:
        if s.admitted:  # only a prefilling sequence that cannot get blocks
            s.preempt_newest()
        return []
    return [Scheduled(r, 1, "decode") for r in batch]


POLICIES: dict[str, Callable[[SchedulerView], list[Scheduled]]] = {
    "mixed": schedule_mixed, "prefill_first": schedule_prefill_first}
