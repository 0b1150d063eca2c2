"""Scoring over the paged cache: log-probabilities of given tokens, the compression method applied (perplexity,
lm-eval log-likelihoods).

    scorer = Scorer(engine)
    logprobs = scorer.score(token_ids)                                      # [T-1], streamed chunk by chunk
    logprobs, greedy = scorer.score_continuation(context_ids, continuation_ids)
    answers = scorer.score_continuations(context_ids, [choice_a, choice_b])  # one prefill, a fork per choice

The scorer feeds tokens through the engine's public chunk API (`Engine.forward_chunk`, `fork_sequence`,
`end_sequence`); each call takes a sequence of its own and frees it at the end. The engine generates; the scorer
only reads the logits of tokens it is given.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch

from kvbench.runtime.serving.log_probs import target_log_probs


class Scorer:
    """Log-probabilities of token sequences through `engine` (an Engine) and its method."""

    def __init__(self, engine: Any):
        self.engine = engine

    @torch.no_grad()
    def score(self, token_ids: Sequence[int], chunk_size: int | None = None,
              progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """log p(token[t+1] | tokens[<=t]) for t = 0..T-2, float64 [T-1] (log_probs.target_log_probs: equal to a
        float64 log-softmax of the logits to ~1e-7 nats, over any vocabulary).

        The tokens stream through the cache chunk by chunk; every chunk ends a prompt as far as the
        method is concerned (it compresses after each, whatever its prefill_mode), so later chunks are
        scored against the compressed cache. progress(n) after each chunk of n tokens.
        """
        engine = self.engine
        chunk = chunk_size or engine.prefill_chunk_size
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if ids.numel() < 2:
            raise ValueError("score needs at least 2 tokens")
        check = getattr(engine, "check_positions", None)  # the text within the model's positions
        if check is not None:
            check(ids.numel())
        slot = engine.new_sequence()
        out = torch.empty(ids.numel() - 1, dtype=torch.float64)
        try:
            for a, b, logits in self.prefill_chunks(slot, ids.tolist(), chunk, logits_for="all", progress=progress,
                                                    stream=True):
                tgt_end = min(b, ids.numel() - 1)
                if tgt_end > a:  # logits [1, b-a, V]: row t predicts token t+1
                    out[a:tgt_end] = target_log_probs(logits[0, : tgt_end - a], ids[a + 1: tgt_end + 1]).cpu()
        finally:
            engine.end_sequence(slot)
        return out

    @torch.no_grad()
    def score_continuation(self, context_ids: Sequence[int], continuation_ids: Sequence[int],
                           chunk_size: int | None = None) -> tuple[list[float], bool]:
        """log p of every continuation token, scored against the context as the method left it in the cache.

        The context but its last token is prefilled chunk by chunk (the method compresses it as any prompt);
        then its last token and the continuation but its last token go in as one more chunk, whose logits give
        every continuation token's log-prob, each predicted from the compressed cache. Returns (log-probs,
        greedy), greedy saying whether every continuation token is the argmax. The sequence is freed at the end.
        """
        return self.score_continuations(context_ids, [continuation_ids], chunk_size)[0]

    @torch.no_grad()
    def score_continuations(self, context_ids: Sequence[int], continuations: Sequence[Sequence[int]],
                            chunk_size: int | None = None) -> list[tuple[list[float], bool]]:
        """score_continuation for several continuations of one context (a multiple-choice question): the context
        is prefilled and compressed once, and each continuation is scored on a fork of that sequence, sharing its
        blocks (copy-on-write), with the method's state copied. Same results as one call per continuation."""
        engine = self.engine
        ctx = [int(t) for t in context_ids]
        conts = [[int(t) for t in c] for c in continuations]
        if not ctx or not conts or any(not c for c in conts):
            raise ValueError("score_continuation needs a non-empty context and continuation")
        check = getattr(engine, "check_positions", None)  # the context and its longest continuation
        if check is not None:
            check(len(ctx) + max(len(c) for c in conts) - 1)
        chunk = chunk_size or engine.prefill_chunk_size
        head = ctx[:-1]
        parent = engine.new_sequence()
        out: list[tuple[list[float], bool]] = []
        try:
            for _ in self.prefill_chunks(parent, head, chunk, logits_for="none"):
                pass
            for i, cont in enumerate(conts):
                last = i == len(conts) - 1
                slot = parent if last else engine.fork_sequence(parent)  # the last one goes on in the original
                try:
                    out.append(self._score_feed(slot, len(head), ctx[-1:] + cont[:-1], cont, chunk))
                finally:
                    if not last:
                        engine.end_sequence(slot)
        finally:
            if parent in engine.cache.live:
                engine.end_sequence(parent)
        return out

    def prefill_chunks(self, slot: int, token_ids: Sequence[int], chunk_size: int, start_pos: int = 0, *,
                       stream: bool = False, logits_for: str = "last",
                       progress: Callable[[int], None] | None = None) -> Iterator[tuple[int, int, Any]]:
        """Feed token_ids into sequence `slot` chunk by chunk (positions start_pos..); yields each chunk's
        (start, end, logits). The last chunk ends the prompt (the method may compress); stream=True: every chunk."""
        ids = [int(t) for t in token_ids]
        n = len(ids)
        for a in range(0, n, chunk_size):
            b = min(n, a + chunk_size)
            out = self.engine.forward_chunk(slot, ids[a:b], start_pos + a, last_chunk=stream or b == n,
                                            logits_for=logits_for)
            if progress is not None:
                progress(b - a)
            yield a, b, out

    def _score_feed(self, slot: int, start: int, feed: list[int], cont: list[int],
                    chunk: int) -> tuple[list[float], bool]:
        """Log-probs of `cont` from the logits of `feed` (its tokens shifted by one) appended at position start,
        and whether each is the argmax."""
        logprobs: list[float] = []
        greedy = True
        for a, b, logits in self.prefill_chunks(slot, feed, chunk, start_pos=start, logits_for="all"):
            tgt = torch.tensor(cont[a:b], dtype=torch.int64, device=logits.device)
            logprobs.extend(target_log_probs(logits[0], tgt).cpu().tolist())  # [b-a]
            greedy = greedy and bool((logits[0].argmax(-1) == tgt).all())
        return logprobs, greedy
