"""Batched generation and chunked prefill give the same results as the simple paths."""
from __future__ import annotations

import pytest
import torch

from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=5)


def _prompts(n, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (L,), generator=g).tolist() for L in lengths[:n]]


def test_batched_generation_equals_one_by_one(model):
    prompts = _prompts(5, [3, 40, 17, 65, 8])
    batched = Engine(model, block_size=8, prefill_chunk_size=16).generate(prompts, max_new_tokens=24)
    for p, b in zip(prompts, batched):
        alone = Engine(model, block_size=8, prefill_chunk_size=16).generate([p], max_new_tokens=24)[0]
        assert b.token_ids == alone.token_ids


def test_stop_tokens_end_sequences_independently(model):
    prompts = _prompts(3, [10, 20, 30], seed=1)
    free = Engine(model).generate(prompts, max_new_tokens=12)
    stop = free[1].token_ids[3]
    gens = Engine(model).generate(prompts, max_new_tokens=12, stop_token_ids=[stop])
    assert gens[1].finish_reason == "stop" and gens[1].token_ids[-1] == stop
    assert len(gens[1].token_ids) == free[1].token_ids.index(stop) + 1
    for g, f in zip(gens, free):
        n = len(g.token_ids)
        assert g.token_ids == f.token_ids[:n]


@pytest.mark.parametrize("chunk", [1, 7, 64, 300])
def test_chunked_prefill_gives_the_same_logits(model, chunk):
    ids = _prompts(1, [300], seed=2)[0]
    one = Scorer(Engine(model, prefill_chunk_size=1000)).score(ids)
    chunked = Scorer(Engine(model, prefill_chunk_size=chunk)).score(ids)
    assert (one - chunked).abs().max().item() <= 1e-4


def test_sampling_is_seeded(model):
    prompts = _prompts(2, [12, 30], seed=3)
    a = Engine(model).generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    b = Engine(model).generate(prompts, max_new_tokens=10, temperature=0.9, top_p=0.9, seed=7)
    greedy = Engine(model).generate(prompts, max_new_tokens=10)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in greedy]


def test_pool_is_empty_after_generation(model):
    eng = Engine(model, block_size=4)
    eng.generate(_prompts(3, [5, 9, 33]), max_new_tokens=6)
    assert eng.cache.pool.in_use == 0
    eng.cache.pool.check_consistency()


def test_sampled_rows_are_the_steps_own_logits_or_a_copy():
    """Engine._run samples a decode step's logits rows as their own [S, V] matrix (no copy) only when they are its
    rows 0..S-1 in order; any other selection is stacked."""
    from kvbench.runtime.serving.engine import _as_matrix

    x = torch.randn(4, 10)
    rows = list(x)
    assert _as_matrix(rows) is x
    for pick in (rows[:3], rows[1:], [rows[1], rows[0], rows[2], rows[3]], [rows[0], rows[0], rows[2], rows[3]]):
        got = _as_matrix(pick)
        assert got is not x and torch.equal(got, torch.stack(pick))
    t = torch.randn(10, 4).t()  # rows of a transposed matrix: not rows of their base
    assert torch.equal(_as_matrix(list(t)), t)
    assert torch.equal(_as_matrix(list(x[:, :5])), x[:, :5])  # the rows' first halves: shorter than the base's rows
    a, b = torch.randn(10), torch.randn(10)  # no common base
    assert torch.equal(_as_matrix([a, b]), torch.stack([a, b]))
