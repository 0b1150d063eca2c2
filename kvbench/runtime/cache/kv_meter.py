"""What a run's KV cache held, measured while it runs: the engine's memory figures (`Engine.memory_stats`).

The pool gives the bytes held (its peak); this meter adds what an uncompressed cache would have held for the same
live sequences at its peak (full_kv_bytes), what their tables held at that moment (held_kv_bytes: the method
removed full - held), the most bytes forks shared at once, and the longest sequence (tokens appended to
one sequence: was the budget ever reached). The engine calls `track` after each step's blocks are settled, again
after a method's `after_prefill_chunk` hook (which may evict: KVzip), and `saw_sequence` when a sequence ends.

A model with sliding-window layers (cache.layer_windows) keeps a ring of each window in those layers, whatever the
method: an uncompressed cache holds there what the ring holds, so full_kv_bytes counts the sliding layers' tables as
they are (measured) and the full layers' at every token seen; the figures are also split by layer type
(`by_layer_type`: the full and sliding layers' uncompressed bytes at the peak, and the most bytes each type's tables
held at once, read from the tables after each step and right after each step's allocation), so "KV saved" is the
method's saving on the full layers. Within a step a sliding layer's ring also holds the step's new tokens (a prefill
chunk) before it slides, so the pool peaks above full_kv_bytes even for a full run: the peak is set against
`full_peak_kv_bytes` instead (an uncompressed cache's peak, within a step too).
"""
from __future__ import annotations

from typing import Any

from kvbench.runtime.cache.kv_geometry import blocks_for_tokens


class DecodeReads:
    """K/V bytes the decode steps' attention kernels were given, counted as the steps run (one-token decode steps;
    prefill chunks and multi-token verification steps are not counted), and the bytes full attention over an
    uncompressed cache would have read for the same steps (every block of every token appended to the sequences,
    evicted ones included, in the model dtype). Counts computed on the device stay there until `stats`."""

    def __init__(self):
        self.tokens = 0  # tokens the counted steps decoded (one per sequence per step)
        self.full_bytes = 0  # what full attention over uncompressed caches reads for the same steps
        self.read_bytes = 0  # K/V bytes given to the kernels (an int, or a device tensor once one was added)
        self.summary_bytes = 0  # key summaries the retrieving layers scored

    def step(self, tokens: int, uncompressed_bytes: int) -> None:
        """A decode step of `tokens` sequences, whose uncompressed caches would span `uncompressed_bytes`."""
        self.tokens += tokens
        self.full_bytes += uncompressed_bytes

    def read(self, nbytes) -> None:
        """K/V bytes the step's attention was given (an int, or a device tensor: no host read)."""
        self.read_bytes = self.read_bytes + nbytes

    def scored(self, nbytes: int) -> None:
        """Key-summary bytes a retrieving layer scored."""
        self.summary_bytes += nbytes

    def stats(self) -> dict:
        """kv_read_bytes_per_token (K/V bytes given to the decode kernels per decoded token), kv_read_fraction (of
        what full attention over an uncompressed cache reads for the same steps), summary_read_bytes_per_token (key
        summaries scored)."""
        if self.tokens == 0:
            return {"kv_read_bytes_per_token": None, "kv_read_fraction": None, "summary_read_bytes_per_token": None}
        read = float(self.read_bytes)
        return {"kv_read_bytes_per_token": read / self.tokens,
                "kv_read_fraction": read / self.full_bytes if self.full_bytes else None,
                "summary_read_bytes_per_token": self.summary_bytes / self.tokens}


class KVMeter:
    """Peaks of one cache's uncompressed and held bytes (sizes are kv_geometry's)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.peak_full_bytes = 0
        # measured at the moment peak_full_bytes was reached (or right after the method's hook then): bytes the
        # live tables held (a block shared by n forks counts n times, as it would in n uncompressed caches), so
        # what the method removed is peak_full_bytes - held_at_full_peak
        self.held_at_full_peak = 0
        self.peak_fork_shared_bytes = 0  # the most bytes forks shared at once (held once in the pool)
        self.max_sequence_tokens = 0  # the most tokens one sequence appended (budget reached or not)
        windows = tuple(getattr(cache, "layer_windows", ()) or ())
        self.sliding = [i for i, w in enumerate(windows) if w is not None]  # sliding layers (none: all full)
        self.full_layers = [i for i in range(cache.num_layers) if i not in set(self.sliding)]
        # by layer type: uncompressed bytes at the peak of full_kv_bytes, and the most bytes its tables held
        self.type_full_at_peak = {"full": 0, "sliding": 0}
        self.type_peak_held = {"full": 0, "sliding": 0}

    def track(self, after_method_hook: bool = False) -> None:
        """Update the peaks from the live sequences' tokens and the pool, now (after_method_hook: right after the
        method's after_prefill_chunk hook, which may have evicted since the step's own call)."""
        c = self.cache
        bs = c.block_size
        per_block = c.uncompressed_block_bytes()  # model dtype
        scratch = getattr(c, "scratch_slots", ())  # a method's own pass: not in the uncompressed figure
        counted = [s for s in c.live if s not in scratch]
        blocks = sum(blocks_for_tokens(c.tokens_seen[s], bs) for s in counted) * len(self.full_layers) * c.num_kv_heads
        full = blocks * per_block
        sliding_full = 0
        if self.sliding:
            live = sorted(c.live)
            counted_rows = [i for i, s in enumerate(live) if s not in scratch]
            # a scratch fork's shared blocks are its sequence's: each block once (PagedKVCache.held_lengths)
            lengths = c.held_lengths(live) if any(s in scratch for s in live) else c.host_lengths[live]
            held = {kind: c.held_bytes(lengths[:, layers], layers) if live else 0
                    for kind, layers in (("full", self.full_layers), ("sliding", self.sliding))}
            for kind, n in held.items():
                self.type_peak_held[kind] = max(self.type_peak_held[kind], n)
            # never compressed: what an uncompressed cache holds there is what the ring holds (in the model dtype)
            sliding_full = (int(blocks_for_tokens(c.host_lengths[live][counted_rows][:, self.sliding], bs).sum())
                            * per_block if counted_rows else 0)
        shared = c.fork_shared_bytes()
        if not any(s in scratch for s in c.live):  # a scratch fork shares its sequence's blocks for one pass: no
            # fork of the workload (nothing else steps during the pass, so the workload's sharing is as last tracked)
            self.peak_fork_shared_bytes = max(self.peak_fork_shared_bytes, shared)
        # right after a method's after_prefill_chunk hook, at the same peak: what it evicted there (KVzip, once its
        # prompt's last chunk is in) counts, as an eviction inside the step would
        now_full = full + sliding_full
        if now_full > self.peak_full_bytes or (after_method_hook and now_full == self.peak_full_bytes):
            self.peak_full_bytes = full + sliding_full
            self.type_full_at_peak = {"full": full, "sliding": sliding_full}
            self.held_at_full_peak = c.kv_bytes_in_use() + shared

    def saw_sequence(self, slot: int) -> None:
        """Sequence `slot` ends: count its appended tokens toward the longest sequence."""
        self.max_sequence_tokens = max(self.max_sequence_tokens, self.cache.tokens_seen[slot])

    def stats(self) -> dict:
        """Figures measured from the pool: peak bytes held (peak_kv_bytes, of kv_pool_bytes), the most bytes an
        uncompressed cache would have held for the live sequences (full_kv_bytes), what their block tables held
        at that moment (held_kv_bytes) and the most bytes forks shared at once (fork_shared_kv_bytes: referenced
        by several tables, held once in the pool)."""
        c = self.cache
        reads = c.decode_reads.stats()
        return {
            **reads,
            "peak_kv_bytes": c.peak_kv_bytes(),
            "full_kv_bytes": self.peak_full_bytes,
            "held_kv_bytes": self.held_at_full_peak,
            "fork_shared_kv_bytes": self.peak_fork_shared_bytes,
            "kv_bytes_per_token": c.kv_bytes_per_token(),
            "kv_bytes_in_use": c.kv_bytes_in_use(),
            "block_size": c.block_size,
            "num_blocks": c.pool.num_blocks,
            "peak_blocks_in_use": c.pool.peak_in_use,
            "kv_pool_bytes": c.pool_bytes(),
            "max_sequence_tokens": self.max_sequence_tokens,  # compare with the budget: was it ever reached?
            **self.by_layer_type(),
        }

    def by_layer_type(self) -> dict:
        """{} for a model whose layers are all full; else the split (flat keys, as metrics.json records them):
        full_kv_bytes_{full,sliding}_layers (uncompressed bytes at the peak of full_kv_bytes) and
        peak_kv_bytes_{full,sliding}_layers (the most bytes each type's tables held at once: within a step, right
        after its allocation, a sliding layer also holds the step's new tokens, a prefill chunk), with the layer
        counts."""
        if not self.sliding:
            return {}
        out = {"full_layers": len(self.full_layers), "sliding_layers": len(self.sliding)}
        in_step = getattr(self.cache, "layer_type_peaks", {})  # right after each step's allocation
        for kind in ("full", "sliding"):
            out[f"full_kv_bytes_{kind}_layers"] = self.type_full_at_peak[kind]
            out[f"peak_kv_bytes_{kind}_layers"] = max(self.type_peak_held[kind], in_step.get(f"{kind}_bytes", 0))
        # what an uncompressed cache of this runtime peaks at, within a step too (a prefill chunk sits in a sliding
        # layer's ring before it slides): the most of the full layers at every token appended plus the sliding
        # layers' rings as held (never compressed), right after each step's allocation, or between steps. A full
        # run's pool peaks at such a moment with exactly these blocks: its saving at the peak is 0, never negative
        out["full_peak_kv_bytes"] = max(self.peak_full_bytes,
                                        in_step.get("uncompressed_blocks", 0) * self.cache.uncompressed_block_bytes())
        return out

    def sequence(self, slot: int) -> dict:
        """What live sequence `slot` holds now, from its block tables: the most and the mean tokens of its
        (layer, kv-head) tables, and its KV bytes (the blocks its tables hold, each at its layer's block size)."""
        lengths = self.cache.lengths[slot]  # [L, H]
        return {"max_table_tokens": int(lengths.max()), "mean_table_tokens": float(lengths.float().mean()),
                "kv_bytes": self.cache.held_bytes(self.cache.host_lengths[slot])}
