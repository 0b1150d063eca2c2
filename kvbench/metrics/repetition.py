"""Degenerate generations: a token, a bigram or a short cycle repeated over most of an output.

    repetition_share([5] * 32)                         # 0.97: each token repeats the one before
    repetition_share([3, 4] * 16)                      # 0.94: the bigram (3, 4) over and over
    repetition_share(["This", "We", "ak", "S", "ynt", "ax"] * 5)   # 0.8: a 6-token cycle
    is_degenerate(token_ids)                           # repetition_share >= 0.5 over at least MIN_TOKENS tokens

A cache that lost what the model needs (a chat prompt's template tail, the attention sinks) shows up this way
("ThisThisThis...") long before a task metric says why. Works on any sequence of hashable items (token ids,
words); natural text scores low (a summary of 32 SmolLM2 tokens: about 0.03-0.1).
"""
from __future__ import annotations

from typing import Hashable, Sequence

DEGENERATE_SHARE = 0.5  # "most of the output"
MIN_TOKENS = 8  # shorter outputs (a short answer, an early stop) are never called degenerate
MAX_PERIOD = 8  # cycles up to this many tokens (a token: 1, a bigram: 2, "ThisWeakSyntax": 6)


def repetition_share(tokens: Sequence[Hashable], max_period: int = MAX_PERIOD) -> float:
    """The largest share of the items that repeat the item `p` places before them, over periods p = 1..max_period
    (one token repeated: p = 1; a bigram: p = 2); 0.0 for fewer than two items."""
    n = len(tokens)
    best = 0
    for p in range(1, min(max_period, n - 1) + 1):
        best = max(best, sum(1 for i in range(p, n) if tokens[i] == tokens[i - p]))
    return best / n if n else 0.0


def is_degenerate(tokens: Sequence[Hashable], share: float = DEGENERATE_SHARE, min_tokens: int = MIN_TOKENS) -> bool:
    """Whether at least `share` of an output of at least `min_tokens` items repeats a short cycle."""
    return len(tokens) >= min_tokens and repetition_share(tokens) >= share
