"""Query-agnostic generation (a request's `uncompressed_tail`: its context compressed, then its question appended
uncompressed): the greedy tokens of every method below, through `run_generation` as the tasks call it, equal the
recorded ones (tests/fixtures/uncompressed_tail_greedy.json, written by `python -m tests.tasks.test_uncompressed_tail
--write`)."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.requests import Request
from kvbench.tasks._generation import GenRequest, run_generation
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import ByteTokenizer, tiny_model

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "uncompressed_tail_greedy.json")
CHUNK, BS, NEW_TOKENS = 32, 16, 8
# (prompt tokens, uncompressed tail): tails shorter than a chunk, longer than one (several tail chunks), a context
# that ends inside a block
PROMPTS = ((150, 20), (140, 70), (203, 5))
# (method, budget, options): eviction by a budget and by a ratio, prefill-only and decode-time policies
METHODS = (
    ("full", None, {}),
    ("snapkv", 48, {}),
    ("snapkv", None, {"compression_ratio": 0.5, "decode": "window", "window": 8}),
    ("streaming_llm", 48, {}),
    ("knorm", 48, {"decode": "evict"}),
    ("h2o", 48, {}),
)
BATCH_SIZES = (1, 3)

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


class _IdText:
    """Predictions as the token ids' text (the tiny model has no real tokenizer)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(t) for t in ids)


def _model():
    return tiny_model(vocab=256, max_positions=512, tokenizer=ByteTokenizer(256))


def _requests() -> list[GenRequest]:
    out = []
    for n, tail in PROMPTS:
        ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        out.append(GenRequest(id=f"{n}-{tail}", dataset=None, prompt="", token_ids=ids, max_new_tokens=NEW_TOKENS,
                              uncompressed_tail=tail))
    return out


def _case_id(name: str, budget, options: dict, batch_size: int) -> str:
    return f"{name}-budget={budget}" + "".join(f"-{k}={v}" for k, v in sorted(options.items())) + f"-bs={batch_size}"


def _greedy(model, name: str, budget, options: dict, batch_size: int) -> list[list[int]]:
    method = build_method(name, budget, **options)
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    outputs, _ = run_generation(engine, _IdText(), _requests(), batch_size=batch_size)
    assert engine.cache.pool.in_use == 0
    return [list(o.token_ids) for o in outputs]


CASES = [(name, budget, opts, bs) for name, budget, opts in METHODS for bs in BATCH_SIZES]


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(*c) for c in CASES])
def test_greedy_tokens_equal_the_recorded_ones(model, golden, case):
    got = _greedy(model, *case)
    assert all(len(t) == NEW_TOKENS for t in got)
    assert got == golden[_case_id(*case)]


if __name__ == "__main__" and "--write" in sys.argv:
    torch.set_num_threads(1)
    m = _model()
    record = {_case_id(*c): _greedy(m, *c) for c in CASES}
    with open(GOLDEN, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {len(record)} cases to {GOLDEN}")


# --------------------------------------------------------------------------- preemption
PREEMPT_NEW_TOKENS = 24


def _tail_requests() -> list[Request]:
    return [Request(list(r.token_ids), PREEMPT_NEW_TOKENS, uncompressed_tail=r.uncompressed_tail)
            for r in _requests()]


def test_preempted_requests_recompute_context_then_tail(model):
    """A pool that holds about two of the three requests: the newest is preempted by recompute and prefilled
    again as the first time, context compressed at its end, then tail and generated tokens uncompressed. With
    nothing evicted (full) the outputs equal a large pool's; with snapkv every prefill chunk stays on its side of
    the context's end, and the method is told to keep exactly the tokens after it."""
    big = Engine(model, None, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    want = [r.output for r in big.serve(_tail_requests()).requests]
    small = Engine(model, None, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=80)
    out = small.serve(_tail_requests())
    assert out.preemptions > 0 and [r.output for r in out.requests] == want

    method = build_method("snapkv", 48)
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=60)
    reqs = _tail_requests()
    kept: dict[int, int] = {}  # slot -> tokens the method was told to keep
    keep = method.keep_uncompressed

    def keep_spy(slot, n):
        kept[slot] = kept.get(slot, 0) + n
        keep(slot, n)

    method.keep_uncompressed = keep_spy
    step = engine.step
    checked = []

    def step_spy(segments, *args, **kwargs):
        for s in segments:
            if s.phase != "prefill":
                continue
            r = next(r for r in reqs if r.slot == s.slot)
            end, stop = r.compressed_end, s.start_pos + len(s.token_ids)
            assert stop <= end or s.start_pos >= end  # no chunk crosses the context's end
            assert s.last_chunk == (stop == end or s.start_pos >= end or stop == len(r.tokens))
            if stop == len(r.tokens):  # the prefill is over: the method kept every token after the context (told
                # right before the step: Engine._tell_method)
                checked.append((kept.get(s.slot, 0), len(r.tokens) - end))
        result = step(segments, *args, **kwargs)
        for s in segments:
            if s.phase == "prefill" and s.start_pos + len(s.token_ids) == len(
                    next(r for r in reqs if r.slot == s.slot).tokens):
                kept.pop(s.slot, None)  # the next admission of a slot starts counting again
        return result

    engine.step = step_spy
    out = engine.serve(reqs)
    assert out.preemptions > 0 and all(len(r.output) == PREEMPT_NEW_TOKENS for r in out.requests)
    assert len(checked) == len(reqs) + out.preemptions
    assert all(got == want for got, want in checked)
    assert engine.cache.pool.in_use == 0
