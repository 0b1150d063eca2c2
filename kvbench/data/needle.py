"""Needle-in-a-haystack prompts over the Paul Graham essays, after gkamradt's LLMTest_NeedleInAHaystack.

Construction (as the original ``insert_needle``): the haystack is the essay corpus (`essay_corpus_text`, repeated
if too short) cut to ``context_length - buffer_tokens - len(needle)`` tokens; the needle's tokens go at
``int(n * depth / 100)``, moved back to just after the previous '.' token (to the start if there is none); depth 100
appends the needle at the end. The context is the decoded token list, so it is about ``context_length -
buffer_tokens`` tokens long (decode/re-encode may shift a few tokens). The original keeps ``buffer_tokens=200`` for
the system message, question and answer; here the default is 0 and ``context_length`` is the haystack size.

Scoring (`needle_score`, no LLM judge): the share of the key phrases found in the lower-cased, whitespace-collapsed
answer; with the defaults ("sandwich", "dolores park") 1.0 means both were retrieved, 0.5 one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from kvbench.data.essays import essay_corpus_text

DEFAULT_NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
DEFAULT_QUESTION = "What is the best thing to do in San Francisco?"
DEFAULT_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
DEFAULT_KEY_PHRASES: tuple[str, ...] = ("sandwich", "dolores park")
# The original's OpenAI provider: a system message, the context as one user turn, then the question.
SYSTEM_PROMPT = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
QUESTION_SUFFIX = " Don't give information outside the document or repeat your findings"


@dataclass(frozen=True)
class NeedleSample:
    """One grid cell: the context with the needle, where it went, and what to ask and expect."""

    context_length: int
    depth_percent: float
    context: str
    needle: str
    question: str
    answer: str
    insertion_token: int  # index of the needle's first token in the context's token list
    num_tokens: int  # tokens of the context before decoding (haystack + needle)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids without special tokens when the tokenizer supports ``add_special_tokens``."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def haystack_tokens(tokenizer: Any, num_tokens: int, corpus: str | None = None) -> list[int]:
    """The first ``num_tokens`` tokens of the corpus (the essays by default), repeating it if it is too short."""
    text = essay_corpus_text() if corpus is None else corpus
    if not text:
        raise ValueError("empty haystack corpus")
    tokens = _encode(tokenizer, text)
    if not tokens:
        raise ValueError("the haystack corpus encodes to no tokens")
    reps = 1
    while len(tokens) < num_tokens:  # as the original, which re-reads the files until long enough
        reps *= 2
        tokens = _encode(tokenizer, "\n\n".join([text] * reps))
    return tokens[:num_tokens]


def insert_needle(
    context_tokens: Sequence[int], needle_tokens: Sequence[int], depth_percent: float, period_tokens: Iterable[int]
) -> tuple[list[int], int]:
    """Insert the needle at ``depth_percent`` of the context, backing off to the previous period token.

    Returns the new token list and the insertion index.
    """
    if not 0 <= depth_percent <= 100:
        raise ValueError(f"depth_percent must be in [0, 100], got {depth_percent}")
    context_tokens, needle_tokens = list(context_tokens), list(needle_tokens)
    if depth_percent == 100:
        return context_tokens + needle_tokens, len(context_tokens)
    periods = set(period_tokens)
    point = int(len(context_tokens) * (depth_percent / 100))
    while point > 0 and context_tokens[point - 1] not in periods:
        point -= 1
    return context_tokens[:point] + needle_tokens + context_tokens[point:], point


def _needle_budget(tokenizer: Any, context_length: int, needle: str, buffer_tokens: int) -> tuple[list[int], int]:
    """The needle's tokens and how many haystack tokens fit beside it."""
    needle_tokens = _encode(tokenizer, needle)
    budget = context_length - buffer_tokens - len(needle_tokens)
    if budget <= 0:
        raise ValueError(
            f"context_length {context_length} leaves no room for the haystack "
            f"(buffer {buffer_tokens}, needle {len(needle_tokens)} tokens)"
        )
    return needle_tokens, budget


def _assemble(
    tokenizer: Any,
    haystack: Sequence[int],
    needle_tokens: list[int],
    context_length: int,
    depth_percent: float,
    needle: str,
    question: str,
    answer: str,
) -> NeedleSample:
    tokens, point = insert_needle(haystack, needle_tokens, depth_percent, _encode(tokenizer, "."))
    return NeedleSample(
        context_length=context_length,
        depth_percent=float(depth_percent),
        context=tokenizer.decode(tokens),
        needle=needle,
        question=question,
        answer=answer,
        insertion_token=point,
        num_tokens=len(tokens),
    )


def make_needle_sample(
    tokenizer: Any,
    context_length: int,
    depth_percent: float,
    needle: str = DEFAULT_NEEDLE,
    question: str = DEFAULT_QUESTION,
    answer: str = DEFAULT_ANSWER,
    corpus: str | None = None,
    buffer_tokens: int = 0,
) -> NeedleSample:
    """Build one needle sample (see the module docstring for the construction)."""
    needle_tokens, budget = _needle_budget(tokenizer, context_length, needle, buffer_tokens)
    haystack = haystack_tokens(tokenizer, budget, corpus)
    return _assemble(tokenizer, haystack, needle_tokens, context_length, depth_percent, needle, question, answer)


def build_needle_context(
    tokenizer: Any,
    context_length: int,
    depth_percent: float,
    needle: str = DEFAULT_NEEDLE,
    corpus: str | None = None,
    buffer_tokens: int = 0,
) -> str:
    """The haystack text with the needle inserted at the sentence boundary before ``depth_percent``."""
    return make_needle_sample(
        tokenizer, context_length, depth_percent, needle=needle, corpus=corpus, buffer_tokens=buffer_tokens
    ).context


def needle_prompt(context: str, question: str = DEFAULT_QUESTION) -> str:
    """Single user message: the context, a blank line, then the question with the original's instruction."""
    return f"{context}\n\n{question}{QUESTION_SUFFIX}"


def linear_depths(num: int, start: float = 0.0, stop: float = 100.0) -> list[int]:
    """``num`` evenly spaced depth percents from ``start`` to ``stop``, rounded to integers (the original's grid)."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    if num == 1:
        return [int(round(start))]
    step = (stop - start) / (num - 1)
    return [int(round(start + i * step)) for i in range(num)]


def needle_grid(
    tokenizer: Any,
    context_lengths: Sequence[int],
    depth_percents: Sequence[float],
    needle: str = DEFAULT_NEEDLE,
    question: str = DEFAULT_QUESTION,
    answer: str = DEFAULT_ANSWER,
    corpus: str | None = None,
    buffer_tokens: int = 0,
) -> list[NeedleSample]:
    """One sample per (length, depth), lengths outer, depths inner; the corpus is encoded once."""
    if not context_lengths or not depth_percents:
        raise ValueError("need at least one context length and one depth")
    full = haystack_tokens(tokenizer, max(context_lengths), corpus)
    samples = []
    for length in context_lengths:
        needle_tokens, budget = _needle_budget(tokenizer, length, needle, buffer_tokens)
        for depth in depth_percents:
            samples.append(
                _assemble(tokenizer, full[:budget], needle_tokens, length, depth, needle, question, answer)
            )
    return samples


def needle_score(prediction: str, key_phrases: Sequence[str] = DEFAULT_KEY_PHRASES) -> float:
    """Share of ``key_phrases`` contained in the answer (case-insensitive, whitespace collapsed): 1.0 = all found."""
    if not key_phrases:
        raise ValueError("need at least one key phrase")
    text = " ".join(prediction.lower().split())
    found = sum(1 for phrase in key_phrases if " ".join(phrase.lower().split()) in text)
    return found / len(key_phrases)
