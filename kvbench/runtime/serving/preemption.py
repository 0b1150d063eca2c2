"""Preemption: what happens to a running request's blocks when the scheduler takes them back, and how a swapped-out
request's blocks come back. The scheduler owns the queues (it moves the request to the waiting head); this module
owns the blocks' side and the counts.

    preemptor = Preemptor(cache, end_sequence, mode="auto", swap=SwapSpace(cache, 2**30))
    preemptor.preempt(req)                 # recompute or swap; req is "waiting" now
    preemptor.swap_in(req, room=reserve)   # a swapped-out req's blocks back, if they fit with `room` to spare

By recompute (`runtime.preemption=recompute`, and whenever swapping is not chosen or has no room) the request's blocks
go back to the pool at once, the method forgets it (`end_sequence`), and its prompt plus the tokens it generated are
prefilled again once it is re-admitted (the method compresses them as any prompt); it is re-admitted only once the
pool has room for the blocks it held (`Request.resume_blocks`: no thrashing). By swapping (`swap`, or `auto` when
moving the blocks out and back costs less than prefilling them again: `swap.should_swap`) the blocks' bytes go to
host memory and the request keeps its slot (the method's per-sequence state waits with it); swapped in, it goes on
where it stopped.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from kvbench.runtime.cache.block_pool import OutOfBlocksError
from kvbench.runtime.cache.swap import should_swap
from kvbench.runtime.serving.requests import Request


class Preemptor:
    """Preempts requests over one cache by recompute or swap (`mode`: recompute | swap | auto; swap and auto need a
    `swap` space), counts the preemptions of both kinds, and keeps the prefill rate the auto rule compares with.
    `end_sequence(slot)` ends a sequence (the method forgets it, its blocks go back to the pool); `on_swap_out(slot)`
    is told of each sequence swapped out."""

    def __init__(self, cache: Any, end_sequence: Callable[[int], None], *, mode: str = "recompute", swap: Any = None,
                 on_swap_out: Optional[Callable[[int], None]] = None):
        if mode != "recompute" and swap is None:
            raise ValueError(f"preemption={mode!r} needs a swap space")
        self.cache, self.end_sequence = cache, end_sequence
        self.mode, self.swap, self.on_swap_out = mode, swap, on_swap_out
        self.preemptions = 0  # both kinds
        self.swap_preemptions = 0
        self._prefill_tokens, self._prefill_s = 0, 0.0  # measured so far (the auto rule)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """Count prefill work the run did (the rate recomputing would prefill at)."""
        self._prefill_tokens += tokens
        self._prefill_s += seconds

    def preempt(self, r: Request, swap: bool = True) -> None:
        """Take r's blocks out of the pool and leave r waiting: swapped out when `swap` allows it and the mode and
        the swap space say so (r keeps its slot), else by recompute (its sequence ends, prompt + generated tokens
        to be prefilled again)."""
        if swap and self._swap_out(r):
            return
        held = self.cache.blocks_held(r.slot) if r.slot is not None else 0
        if r.slot is not None:
            self.end_sequence(r.slot)
            r.slot = None
        r.status, r.fed, r.resume_blocks = "waiting", 0, held
        r.preemptions += 1
        self.preemptions += 1

    def _swap_out(self, r: Request) -> bool:
        """Swap r's blocks out if the mode says so and the swap space has room; whether it did."""
        if self.swap is None or r.slot is None or self.mode == "recompute":
            return False
        held = self.swap.bytes_of(r.slot)
        rate = self._prefill_tokens / self._prefill_s if self._prefill_s > 0 else None
        if not should_swap(self.mode, held, r.fed, self.swap.bandwidth(), rate):
            return False
        if not self.swap.can_swap_out(r.slot):
            return False
        self.swap.swap_out(r.slot)
        if self.on_swap_out is not None:
            self.on_swap_out(r.slot)
        r.swapped_status, r.status = r.status, "waiting"
        r.preemptions += 1
        self.preemptions += 1
        self.swap_preemptions += 1
        return True

    def swap_in(self, r: Request, room: int) -> bool:
        """Bring swapped-out r's blocks back if they fit in the pool's free blocks with `room` blocks to spare; r
        takes back the status it had. Whether it did."""
        need = self.swap.blocks_to_swap_in(r.slot) + room
        if need > self.cache.free_blocks():
            return False
        try:
            self.swap.swap_in(r.slot)
        except OutOfBlocksError:  # a codec's pool: its packed rows did not fit yet
            return False
        r.status, r.swapped_status = r.swapped_status, None
        return True

    def drop_swapped(self, r: Request) -> None:
        """Forget swapped-out r: its host copy is discarded and its sequence ends."""
        self.swap.discard(r.slot)
        self.end_sequence(r.slot)
        r.slot, r.swapped_status = None, None

    def bytes_moved(self) -> tuple[int, int]:
        """Bytes swapped out and in so far."""
        return (self.swap.bytes_out, self.swap.bytes_in) if self.swap is not None else (0, 0)

    def swap_stats(self) -> dict:
        """The swap space's counters (SwapSpace.stats); empty without one."""
        return self.swap.stats() if self.swap is not None else {}
