"""A sequence's budget, decided once for every eviction method, and the prompt compression figures.

The budget of a sequence in a step (`SequenceBudgets.step`):
  budget=N                 N
  compression_ratio=r      int(P * (1 - r)) (kvpress's n_kept), P = the prompt's tokens, known when its last
                           prefill chunk has been written (so with a ratio, prefill evicts once, at that chunk,
                           whatever `prefill_mode`); at least the method's `min_budget()`; fixed from then on
  + uncompressed tokens    tokens appended through `keep_uncompressed` (a question after its compressed context)
                           are never evicted in their own step and add to the sequence's budget.
The budget is handed to the method's eviction as an argument; nothing on the method changes.
"""
from __future__ import annotations

from typing import Any, Optional


class SequenceBudgets:
    """Per sequence slot: the prompt's budget (from a ratio), the uncompressed tokens, the step held uncompressed."""

    def __init__(self, budget: Optional[int], compression_ratio: Optional[float]):
        self.budget, self.compression_ratio = budget, compression_ratio
        # slot -> {"prompt": budget from the prompt (ratio) or None, "extra": uncompressed tokens, "hold": tokens of
        # the step being appended uncompressed (0 = none)}
        self._sequences: dict[int, dict[str, Any]] = {}

    def clear(self) -> None:
        self._sequences.clear()

    def _seq(self, slot: int) -> dict[str, Any]:
        return self._sequences.setdefault(slot, {"prompt": None, "extra": 0, "hold": 0})

    def hold(self, slot: int, num_tokens: int) -> None:
        """The next step's `num_tokens` tokens of `slot` stay uncompressed and raise its budget."""
        seq = self._seq(slot)
        seq["hold"] = int(num_tokens)
        seq["extra"] += int(num_tokens)

    def release(self, slot: int) -> None:
        """The held step has been appended (every layer has seen it)."""
        self._seq(slot)["hold"] = 0

    def extra(self, slot: int) -> int:
        return int(self._sequences.get(slot, {}).get("extra", 0))

    def step(self, slot: int, seen: int, Q: int, phase: str, last_chunk: bool, min_budget: int) -> tuple[int, bool]:
        """(the budget of `slot` in this step, whether the step is held uncompressed); seen = tokens appended to the
        sequence so far, Q = this step's tokens."""
        seq = self._seq(slot)
        if seen == Q and not seq["hold"]:  # the first step of the sequence now in this slot
            seq.update(prompt=None, extra=0)
        held = bool(seq["hold"]) and seq["hold"] == Q and phase == "prefill"
        if self.budget is None and self.compression_ratio is None:  # a threshold rule (methods.dms): no bound
            return seen, held
        if self.compression_ratio is None:
            return self.budget + seq["extra"], held
        if phase == "prefill" and last_chunk and not held:
            compressible = seen - seq["extra"]  # prompt tokens (a held question is not compressed)
            seq["prompt"] = max(min_budget, int(compressible * (1.0 - self.compression_ratio)))
        # before the prompt's last chunk nothing is evicted: the budget is every token seen
        return (seen if seq["prompt"] is None else seq["prompt"] + seq["extra"]), held

    def end(self, slot: int) -> None:
        self._sequences.pop(slot, None)

    def fork(self, parent: int, child: int) -> None:
        if parent in self._sequences:
            self._sequences[child] = dict(self._sequences[parent])


class KeptStats:
    """Tokens kept per (layer, kv-head) after each prompt's compression, over every prompt and layer."""

    def __init__(self) -> None:
        self.totals = [0.0, 0, 0]  # sum of tokens kept per kv-head, sum of prompt tokens, (prompt, layer) count
        self.by_slot: dict[int, dict[int, tuple[float, int]]] = {}  # slot -> layer -> (kept per kv-head, prompt)

    def record(self, cache: Any, slot: int, layer: int, extra: int) -> None:
        """One layer of `slot` once its prompt is compressed (extra: its uncompressed tokens, not prompt)."""
        prompt = int(cache.tokens_seen[slot]) - int(extra)
        kept = float(cache.lengths[slot, layer].float().mean())  # mean over kv-heads
        self.totals[0] += kept
        self.totals[1] += prompt
        self.totals[2] += 1
        self.by_slot.setdefault(slot, {})[layer] = (kept, prompt)

    def fraction(self, slot: int) -> float | None:
        """The kept fraction of the prompt last compressed in `slot` (mean over its layers and kv-heads), or None."""
        layers = self.by_slot.get(slot)
        if not layers:
            return None
        kept, prompt = sum(k for k, _ in layers.values()), sum(p for _, p in layers.values())
        return round(kept / prompt, 4) if prompt else None

    def forget(self, slot: int) -> None:
        self.by_slot.pop(slot, None)

    @staticmethod
    def stats(totals: list) -> dict[str, Any]:
        """kv_tokens_kept_mean, prompt_tokens_mean and kv_kept_fraction of `totals`."""
        kept, prompt, n = totals
        if not n:
            return {"kv_tokens_kept_mean": None, "prompt_tokens_mean": None, "kv_kept_fraction": None}
        return {"kv_tokens_kept_mean": round(kept / n, 2), "prompt_tokens_mean": round(prompt / n, 2),
                "kv_kept_fraction": round(kept / prompt, 4) if prompt else None}
