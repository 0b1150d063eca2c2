"""kvbench.run.engines: the one place runtime settings become an Engine (the app, the lm-eval adapter, the benches).
Every knob reaches the engine by name, with the two rules a run adds; the draft engine of speculative decoding gets
the target's KV bytes; a real engine built from settings is the engine built by hand."""
from __future__ import annotations

import pytest

from kvbench.run.config import RuntimeConfig
from kvbench.run.engines import SERVING_KNOBS, build_engine, build_run_codec, build_speculator, engine_options
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.speculative import SpeculativeDecoder
from tests.tiny_models import tiny_model


class RecordingEngine:
    """Takes what an Engine takes, keeps it."""

    def __init__(self, model, method=None, **kwargs):
        self.model, self.method, self.kwargs = model, method, kwargs


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=5)


def test_every_knob_of_the_runtime_section_reaches_the_engine_by_name():
    rt = RuntimeConfig(block_size=8, num_blocks=300, prefill_chunk_size=32, attention_backend="torch",
                       max_num_seqs=3, max_num_batched_tokens=64, admission_watermark=0.1, schedule="prefill_first",
                       prefix_caching=True, cuda_graphs=False, preemption="swap", swap_bytes=1 << 20)
    engine = build_engine(rt, "the model", "the method", codec="the codec", engine_cls=RecordingEngine)
    assert (engine.model, engine.method) == ("the model", "the method")
    assert engine.kwargs == dict(codec="the codec", speculator=None, block_size=8, num_blocks=300,
                                 kv_memory_bytes=None, prefill_chunk_size=32, attention_backend="torch",
                                 max_num_seqs=3, max_num_batched_tokens=64, admission_watermark=0.1,
                                 schedule="prefill_first", prefix_caching=True, cuda_graphs=False,
                                 preemption="swap", swap_bytes=1 << 20)
    assert set(SERVING_KNOBS) <= set(engine.kwargs)


def test_speculation_turns_prefix_caching_off_and_tensor_parallel_the_cuda_graphs():
    plain = engine_options(RuntimeConfig(prefix_caching=True))
    assert plain["prefix_caching"] is True and plain["cuda_graphs"] is True
    assert engine_options(RuntimeConfig(prefix_caching="auto", speculative={"num_tokens": 4}))["prefix_caching"] is False
    assert engine_options(RuntimeConfig(tensor_parallel=2))["cuda_graphs"] is False


def test_the_draft_engine_gets_the_targets_kv_bytes_and_no_prefix_cache():
    rt = RuntimeConfig(block_size=8, kv_memory_bytes=1 << 22, prefill_chunk_size=32,
                       speculative={"num_tokens": 3, "adaptive": True}, max_num_seqs=3)
    spec = build_speculator(rt, "target", "draft", "draft method", None, engine_cls=RecordingEngine)
    assert isinstance(spec, SpeculativeDecoder) and spec.num_tokens == 3 and spec.adaptive
    assert spec.draft.model == "draft" and spec.draft.method == "draft method"
    assert spec.draft.kwargs == dict(codec=None, block_size=8, num_blocks=None, kv_memory_bytes=1 << 22,
                                     prefill_chunk_size=32, attention_backend="auto", prefix_caching=False)


def test_full_precision_needs_no_codec(model):
    assert build_run_codec("none", {}, model) is None and build_run_codec("full", {}, model) is None
    kivi = build_run_codec("kivi", {"bits": 4}, model)
    assert kivi is not None and kivi.name == "kivi"


def test_a_real_engine_from_settings_is_the_engine_built_by_hand(model):
    prompts = [[5, 9, 2, 7, 1, 3, 8, 8, 4, 6] * 3, [11, 4, 3] * 5]
    rt = RuntimeConfig(block_size=8, num_blocks=200, prefill_chunk_size=16, max_num_seqs=2)
    built = build_engine(rt, model)
    by_hand = Engine(model, block_size=8, num_blocks=200, prefill_chunk_size=16, max_num_seqs=2)
    assert built.cache.block_size == 8 and built.max_num_seqs == 2 and built.prefill_chunk_size == 16
    assert built.cache.capacity_blocks() == by_hand.cache.capacity_blocks()
    got = [g.token_ids for g in built.generate(prompts, max_new_tokens=10)]
    assert got == [g.token_ids for g in by_hand.generate(prompts, max_new_tokens=10)]
