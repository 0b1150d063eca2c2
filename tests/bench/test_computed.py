"""A speed benchmark times work, never a cache (bench/computed.py): the runtime bench's prefill figure refuses a
prompt that the prefix cache served, and passes when every prompt token was computed."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import tiny_model

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import their sibling `computed` as scripts do
import bench_runtime  # noqa: E402
from computed import CachedWorkError, require_computed  # noqa: E402


def test_require_computed_both_ways():
    assert require_computed(2048, 2048, "prefill") == 2048
    assert require_computed(2050, 2048, "prefill") == 2050  # recompute after preemption counts as work too
    with pytest.raises(CachedWorkError, match="computed 2032 of 2048"):
        require_computed(2032, 2048, "prefill")


def test_runtime_bench_refuses_a_prefill_the_prefix_cache_served():
    prompt = list(range(10, 74))  # 64 tokens: four full blocks of 16, cached after the first run
    cached = Engine(tiny_model(vocab=256), prefill_chunk_size=64, prefix_caching=True)
    assert bench_runtime.kv_prefill_tps(cached, prompt) > 0  # the first run computes the prompt
    with pytest.raises(CachedWorkError):
        bench_runtime.kv_prefill_tps(cached, prompt)  # the repeat would time the cache


def test_runtime_bench_times_every_repeat_without_the_cache():
    prompt = list(range(10, 74))
    engine = Engine(tiny_model(vocab=256), prefill_chunk_size=64, prefix_caching=False)
    for _ in range(3):
        assert bench_runtime.kv_prefill_tps(engine, prompt) > 0
        assert bench_runtime.kv_prefill_tps(engine, prompt, chunk=16) > 0
