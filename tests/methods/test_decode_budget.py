"""A long generation (1,024 new tokens after a 100-token prompt) under budget 256: every (layer, kv-head) table stays within budget + one block after every
step (checked in after_attention, tests/methods/test_matrix.Checker) for the decode-time methods of the reasoning
experiment, while the full cache grows with every token; the freed blocks go back to the pool. The packaged-model
run (2,048 new tokens at budget 256) is the smoke experiment's (+experiment=reasoning_decode scale=smoke)."""
from __future__ import annotations

import pytest
import torch

from kvbench.methods import build_method
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_matrix import Checker
from tests.tiny_models import tiny_model

BUDGET, BLOCK, NEW_TOKENS, PROMPT = 256, 16, 1024, 100  # a short prompt, then a trace 4x the budget
DECODE_TIME = [
    ("rkv", {"buffer": BLOCK}),  # one-block staging buffer: the bound budget + one block (official buffer: 128)
    ("h2o", {}),
    ("streaming_llm", {}),
    ("paged_eviction", {}),
    ("snapkv", {"decode": "window"}),
    ("snapkv", {"decode": "rescore", "window": 8, "kernel_size": 7, "pooling": "maxpool"}),
]

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, layers=1, hidden=32, heads=2, kv_heads=1, intermediate=32,
                      max_positions=PROMPT + NEW_TOKENS + 8)


@pytest.mark.parametrize("name,opts", DECODE_TIME, ids=lambda v: str(v) if not isinstance(v, dict) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_long_generation_stays_within_budget_plus_one_block(model, name, opts):
    method = build_method(name, BUDGET, **opts)
    checker = Checker(method, BUDGET, BLOCK)  # asserts the bound after every layer of every step
    if name == "rkv":  # the matrix's checker allows rkv its staging buffer; here the buffer is one block
        assert method.decode_overshoot() == BLOCK - 1
    engine = Engine(model, method, block_size=BLOCK, num_blocks=1024)
    prompt = torch.randint(1, 256, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = engine.generate([prompt], max_new_tokens=NEW_TOKENS)[0]
    assert len(gen.token_ids) == NEW_TOKENS  # no stop tokens given: the whole trace
    assert checker.calls >= NEW_TOKENS
    assert BUDGET <= checker.max_kept <= BUDGET + BLOCK - 1
    stats = engine.memory_stats()
    blocks_bound = -(-(BUDGET + BLOCK - 1) // BLOCK)  # per table
    assert stats["peak_blocks_in_use"] <= blocks_bound * model.config.num_kv_heads * model.config.num_layers
    assert stats["full_kv_bytes"] >= (PROMPT + NEW_TOKENS - 1) * stats["kv_bytes_per_token"]
    assert engine.cache.pool.in_use == 0


def test_full_cache_grows_with_every_token(model):
    method = build_method("full")
    checker = Checker(method, None, BLOCK)
    engine = Engine(model, method, block_size=BLOCK, num_blocks=1024)
    engine.generate([list(range(1, 101))], max_new_tokens=400)
    assert checker.max_kept == 100 + 400 - 1
