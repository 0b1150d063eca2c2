"""The repetition check (metrics/repetition.py) and the failure it was written for: PagedEviction on a chat prompt
at a moderate budget degenerated to "ThisThisThis..." until its prefill kept the prompt's last block."""
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


@pytest.fixture(scope="module")
def chat_paper(smollm2):
    """The first ACLSum test paper as the paged_eviction_longbench smoke prompts it (1,024 tokens + the template)."""
    from kvbench.data.aclsum import load_aclsum
    from kvbench.tasks.summarization import DEFAULT_PROMPT, summarization_requests

    docs = load_aclsum("test", limit=1)
    return summarization_requests(smollm2.tokenizer, docs, DEFAULT_PROMPT, 1024, 16, True, "aclsum")[0]


@pytest.mark.parametrize("opts,degenerate", [({}, False), ({"protect_last_block": False, "decode_topk": None}, True)])
def test_paged_eviction_keeps_a_chat_prompts_tail_and_generates_text(smollm2, chat_paper, opts, degenerate):
    """Budget 256 of 1,054 prompt tokens, block 16: the authors' rules (first and last block kept at prefill) give
    text; the earlier rules (prefill by score alone after the first block) evict the template's tail and repeat."""
    from kvbench.methods import build_method
    from kvbench.runtime.engine import Engine

    engine = Engine(smollm2.model, build_method("paged_eviction", 256, **opts), block_size=16,
                    kv_memory_bytes=64 << 20, prefix_caching=False)
    out = engine.generate([chat_paper.token_ids], max_new_tokens=16, stop_token_ids=chat_paper.stop_ids)[0]
    text = smollm2.tokenizer.decode(out.token_ids)
    assert is_degenerate(out.token_ids) == degenerate, text
