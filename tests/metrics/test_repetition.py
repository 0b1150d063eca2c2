"""The repetition check (kvbench/metrics/repetition.py): a repeated token, bigram or short cycle is degenerate
("ThisThisThis..."); text, short outputs and a short repeated tail are not; generation samples record their share.
The failure it catches on a real model, a chat prompt whose tail an eviction dropped, is in
tests/methods/test_paged_eviction.py."""
from __future__ import annotations

import pytest

from kvbench.metrics.repetition import is_degenerate, repetition_share

SUMMARY = ("This paper presents a new approach to translate terms based on analogies between the domains of two "
           "languages, and shows that it improves the translation of rare terms").split()


@pytest.mark.parametrize("tokens", [["This"] * 32, ["This", "paper"] * 16, ["This", "We", "ak", "S", "ynt", "ax"] * 6,
                                    SUMMARY[:4] + ["This"] * 28])
def test_a_repeated_token_bigram_or_short_cycle_is_degenerate(tokens):
    assert repetition_share(tokens) >= 0.5 and is_degenerate(tokens)


@pytest.mark.parametrize("tokens", [SUMMARY, list(range(40)), ["This"] * 7, [], ["a"], SUMMARY[:6] + ["x"] * 4])
def test_text_short_outputs_and_a_short_tail_are_not_degenerate(tokens):
    assert not is_degenerate(tokens)
    assert 0.0 <= repetition_share(tokens) < 0.5 or len(tokens) < 8


def test_generation_samples_record_their_repetition():
    from kvbench.tasks._generation import GenOutput, GenRequest

    req = GenRequest(id="0", dataset="d", prompt="p", token_ids=[1, 2], max_new_tokens=8, references=["r"])
    rec = GenOutput(req, "ThisThis", [7] * 8, "length", 0.1, 0.1, 0.1).record(rouge_l=0.0)
    assert rec["repetition"] == 0.875 and rec["rouge_l"] == 0.0
