"""What one engine step runs: the scheduler's choice (Scheduled, one per request) as the model runner's input
(Segment, one per sequence), vLLM v1's SchedulerOutput in small.

    batch = StepBatch.of(scheduler.schedule())      # schedule
    logits = runner.run(batch.segments)             # run: one ragged forward (kvbench.runtime.serving.model_runner)
    scheduler.postprocess(batch.scheduled, ...)     # postprocess: the tokens sampled for batch.emit
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.runtime.serving.requests import Scheduled


@dataclass
class Segment:
    """One sequence's share of a ragged step: `token_ids` appended to sequence `slot` at positions start_pos..
    (a prefill chunk, or one decode token with phase "decode")."""

    slot: int
    token_ids: list[int]
    start_pos: int
    phase: str = "prefill"  # "prefill" | "decode"
    last_chunk: bool = True  # the prompt ends with this chunk (the method may compress); True for decode


@dataclass
class StepBatch:
    """One scheduler step: what it scheduled, the segments the runner runs (in the same order), and which of them
    give their request's next token (its last prompt chunk, a decode token)."""

    scheduled: list[Scheduled]
    segments: list[Segment]
    emit: list[int]  # indices into segments whose logits are sampled

    @classmethod
    def of(cls, scheduled: list[Scheduled]) -> "StepBatch":
        """The step's segments: each request's n tokens from req.fed on, at their positions."""
        segments = [Segment(sc.req.slot, sc.req.tokens[sc.req.fed:sc.req.fed + sc.n], sc.req.fed,
                            "decode" if sc.kind == "decode" else "prefill", sc.last_chunk)
                    for sc in scheduled]
        return cls(scheduled, segments, [i for i, sc in enumerate(scheduled) if sc.emits])

    @property
    def num_tokens(self) -> int:
        """Tokens the step runs, prompt tokens included."""
        return sum(sc.n for sc in self.scheduled)
