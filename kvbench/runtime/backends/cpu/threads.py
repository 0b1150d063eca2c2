"""CPU thread policy: how many OpenMP threads, and how they wait, so speed holds on a shared machine.

Why: torch, oneDNN and kvbench's C kernels share one OpenMP runtime (torch's libgomp). A decode step opens
hundreds of short parallel regions (about ten per layer), and by default a libgomp thread that reaches the end of
a region spins for about 300,000 pause loops (milliseconds) waiting for its partner before it sleeps. When another
process competes for the cores, the partner thread is often not running, and the spinning thread burns the very
core the partner needs, at every region: two threads then run several times slower than one (the benchmarks page
in docs/ has the figures; `make bench` measures the current machine).

The policy (applied by `apply_wait_policy`, called from kvbench/__init__.py before torch is imported):
- threads that finish a region spin only briefly (GOMP_SPINCOUNT=SPIN_COUNT), then sleep, so a thread that was
  preempted gets its core back at once, while on an idle machine the short spin still catches the partner;
- a user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT is left alone.
libgomp reads these variables once, when torch loads it: if torch was imported before kvbench, the default
(long spin) stays, and `configure_threads` says so once in the log.

`StepThreads` (used by LlamaFamilyModel.forward on CPU) then picks, per decode-sized step, 1 thread or all of
them, whichever its timed steps show faster.

`configure_threads(requested)` sets torch's intra-op thread count (the C kernels follow it) and returns it; the
app calls it once before the model runs (`runtime.threads`, null = the cores this process may use).
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

log = logging.getLogger(__name__)

SPIN_COUNT = "1000"  # pause loops before a waiting OpenMP thread sleeps (libgomp's default: 300000)
_USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_state = {"applied": False, "torch_was_loaded": False, "warned": False}


def apply_wait_policy() -> bool:
    """Set kvbench's OpenMP waiting policy in the environment unless the user chose one. It takes effect only if
    torch (libgomp) is not loaded yet; returns whether kvbench's policy is in effect."""
    if any(key in os.environ for key in _USER_KEYS) and not _state["applied"]:
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
    if not _state["applied"]:
        _state["applied"] = True
        _state["torch_was_loaded"] = "torch" in sys.modules
    return not _state["torch_was_loaded"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; cgroup CPU quotas are not read)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def policy_in_effect() -> bool:
    """Whether OpenMP threads wait briefly (kvbench's policy or the user's own), rather than libgomp's long spin."""
    user_set = any(key in os.environ for key in _USER_KEYS) and not _state["applied"]
    return user_set or (_state["applied"] and not _state["torch_was_loaded"])


def configure_threads(requested: int | None = None) -> int:
    """Set torch's intra-op threads to `requested` (None: torch's default, at most the usable cores); return the
    count. Logs once when more than one thread will spin-wait (torch imported before kvbench, no user policy)."""
    import torch

    n = requested if requested else min(torch.get_num_threads(), usable_cores())
    n = max(1, int(n))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if n > 1 and not policy_in_effect() and not _state["warned"]:
        _state["warned"] = True
        log.warning("torch was imported before kvbench, so its %d OpenMP threads spin-wait and can run many times "
                    "slower when other processes compete for the cores; set GOMP_SPINCOUNT=%s (or "
                    "OMP_WAIT_POLICY=PASSIVE) in the environment, or use runtime.threads=1", n, SPIN_COUNT)
    return n


class StepThreads:
    """Chooses the thread count of decode-sized forward steps (at most `max_tokens` tokens) by timing them.

    With one competing CPU-bound process on 2 cores, two threads that meet at every parallel region run at a
    fraction of their idle speed while one thread keeps most of it; idle, two threads are as fast or faster. So
    each step size runs mostly with the faster count known so far and, now and then, once with the other; the
    faster one (exponential average of step times) is kept. The other count is tried at the second step, then
    every `explore_every` steps; an exploration that loses multiplies the wait by `backoff` (up to
    `max_explore_every` steps), a switch resets it. Two steps in a row of the best count slower than `trigger` x
    its average (load has come) are followed by an exploration at once. An exploration costs about one step at half speed on
    an idle machine (with a wait of 8 doubling to 64, short generations ran measurably slower than with two threads
    throughout: docs/benchmark-results.md); the trigger keeps the reaction to load within three steps
    while the periodic tries grow rare. Larger steps (prefill) always use every thread. After each step the
    previous count is restored, so code between steps (and other libraries in the process) sees the configured
    threads."""

    def __init__(self, max_tokens: int = 4, explore_every: int = 16, max_explore_every: int = 256,
                 backoff: int = 4, trigger: float = 1.5,
                 margin: float = 0.95, clock: Callable[[], float] = time.perf_counter,
                 get_threads: Callable[[], int] | None = None, set_threads: Callable[[int], None] | None = None):
        import torch

        self.max_tokens, self.base_explore, self.max_explore, self.margin = max_tokens, explore_every, \
            max_explore_every, margin
        self.backoff, self.trigger = backoff, trigger
        self.clock = clock
        self.get_threads = get_threads or torch.get_num_threads
        self.set_threads = set_threads or torch.set_num_threads
        self.stats: dict[int, dict] = {}  # tokens per step -> {"best": n, "ema": {n: s}, "wait": k, "count": i}
        self._step: tuple | None = None

    def begin(self, tokens: int) -> int:
        """Before a step of `tokens` tokens: set and return the thread count it runs with."""
        configured = self.get_threads()
        self._step = None
        if configured <= 1 or tokens > self.max_tokens:
            return configured
        st = self.stats.setdefault(tokens, {"best": configured, "ema": {}, "wait": self.base_explore, "count": 0})
        if st["best"] not in (1, configured):  # the configured count changed since
            st.update(best=configured, ema={}, wait=self.base_explore, count=0)
        st["count"] += 1
        other = 1 if st["best"] == configured else configured
        explore = (st["count"] % st["wait"] == 0 or other not in st["ema"] and st["count"] >= 2
                   or st.pop("suspect", False))
        n = other if explore else st["best"]
        if n != configured:
            self.set_threads(n)
        self._step = (tokens, n, configured, self.clock())
        return n

    def end(self) -> None:
        """After the step: record its time, pick the faster count, restore the configured threads."""
        if self._step is None:
            return
        tokens, n, configured, t0 = self._step
        self._step = None
        seconds = self.clock() - t0
        if n != configured:
            self.set_threads(configured)
        st = self.stats[tokens]
        ema = st["ema"]
        if n == st["best"] and n in ema:  # two steps in a row much slower than usual: load may have come (one
            # slow step alone may be a page-fault storm), so the other count is tried at the next step
            st["slow"] = st.get("slow", 0) + 1 if seconds > self.trigger * ema[n] else 0
            if st["slow"] >= 2:
                st["suspect"], st["slow"] = True, 0
        # the best count's time is averaged; the other count is sampled rarely, so its last sample stands
        ema[n] = 0.7 * ema[n] + 0.3 * seconds if n == st["best"] and n in ema else seconds
        best, other = st["best"], (1 if st["best"] == configured else configured)
        if n == other and best in ema:
            if ema[other] < self.margin * ema[best]:
                st.update(best=other, wait=self.base_explore)
            else:
                st["wait"] = min(self.backoff * st["wait"], self.max_explore)
