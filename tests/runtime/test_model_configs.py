"""Issue 68 item 4: a config.json is honoured as transformers' class for its family honours it, or refused before
the load. Tiny random models against transformers' eager logits:
  * `layer_types` is read by the families whose attention reads it (Qwen2 here) and ignored by the others, as
    transformers ignores it (Llama: no sliding layer, whatever the config says);
  * dynamic NTK RoPE is refused in one line by the model checks (kvbench's tables are fixed);
  * longrope (Phi-3.5 / Phi-4-mini) equals transformers up to original_max_position_embeddings, where transformers
    switches to the long factors and kvbench does not: the model's shape stops there, so the tasks' position
    checks refuse a longer run before the load.
"""
from __future__ import annotations

import pytest

from kvbench.errors import UserError
from kvbench.run.model_checks import check_config, exact_positions
from kvbench.run.model_info import _layer_windows
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.model.forward import SUPPORTED_MODEL_TYPES
from kvbench.runtime.serving.engine import Engine
from tests.runtime.test_architectures import _ids, hf_logits, kvbench_logits
from tests.tiny_models import WINDOW, tiny_hf_model

SLIDING_FIRST = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}


def _logit_gap(hf, n: int = 70, prompt: int = 66) -> float:
    model = build_from_transformers(hf)
    ids = _ids(hf, n)
    got = kvbench_logits(Engine(model, prefill_chunk_size=32, block_size=8, num_blocks=512), ids, prompt)
    return (got - hf_logits(hf, ids)).abs().max().item()


def test_layer_types_on_llama_are_ignored_as_transformers_ignores_them():
    hf = tiny_hf_model("llama", seed=1, eager=True, qk_scale=3, **SLIDING_FIRST)
    assert hf.config.layer_types[0] == "sliding_attention"  # the config carries it; LlamaAttention never reads it
    assert build_from_transformers(hf).config.layer_windows == (None, None)
    assert _logit_gap(hf) <= 1e-4
    cfg = {**hf.config.to_dict(), "model_type": "llama"}
    assert _layer_windows(cfg) == ()  # the shape before the load agrees (no sliding ring in the pool estimate)


def test_layer_types_on_qwen2_are_honoured():
    hf = tiny_hf_model("qwen2", seed=1, eager=True, qk_scale=3, use_sliding_window=True, **SLIDING_FIRST)
    assert build_from_transformers(hf).config.layer_windows == (WINDOW, None)
    assert _logit_gap(hf) <= 1e-4
    ids = _ids(hf, 70)
    windowed = hf_logits(hf, ids)
    hf.config.sliding_window = 10 ** 6  # the window matters: without it transformers' logits differ
    assert (hf_logits(hf, ids) - windowed).abs().max().item() > 1e-3


@pytest.mark.parametrize("key,params", [("rope_scaling", {"type": "dynamic", "factor": 2.0}),
                                        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0})])
def test_dynamic_rope_is_refused(key, params):
    cfg = {**tiny_hf_model("llama").config.to_dict(), "model_type": "llama", key: params}
    with pytest.raises(UserError, match=r"^m: rope_type='dynamic' in config.json \(dynamic NTK scaling\)"):
        check_config(cfg, "m", SUPPORTED_MODEL_TYPES)


def test_longrope_equals_transformers_up_to_its_original_positions_and_stops_there():
    half = 8  # head_dim 16: 8 frequencies
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 64}
    hf = tiny_hf_model("phi3", seed=1, eager=True, qk_scale=3, max_positions=256, rope_parameters=rope,
                       original_max_position_embeddings=64)
    assert _logit_gap(hf, 60, 56) <= 1e-4  # within the original positions: transformers' short factors
    assert _logit_gap(hf, 100, 96) > 1e-3  # past them transformers switches; kvbench would not: hence the limit
    cfg = hf.config.to_dict()
    assert exact_positions(cfg) == 64
    assert exact_positions({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}) == 256
    hub_style = {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                 "rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}
    assert exact_positions(hub_style) == 4096  # Phi-4-mini's config.json
    # the loaded model stops there too, so the engine refuses what the tasks' checks could not see
    model = build_from_transformers(hf)
    assert model.config.max_position_embeddings == 64
    with pytest.raises(ValueError, match="a prompt of 65 tokens passes the model's 64 positions"):
        Engine(model, block_size=8, num_blocks=256).generate([list(range(5, 70))], max_new_tokens=1)


def test_a_prompt_past_the_models_positions_is_refused():
    """A prompt longer than max_position_embeddings (SCBench hub rows of 9,054 tokens on an 8,192-position model ran
    with status ok) is a ValueError naming the limit; at the limit it runs. StreamingLLM's re-indexed positions
    stay inside the cache: exempt."""
    from kvbench.methods import build_method
    from tests.tiny_models import tiny_model

    model = tiny_model(max_positions=64)
    engine = Engine(model, block_size=8, num_blocks=256)
    with pytest.raises(ValueError, match="a prompt of 65 tokens passes the model's 64 positions"):
        engine.generate([list(range(5, 70))], max_new_tokens=1)
    assert len(engine.generate([list(range(5, 69))], max_new_tokens=1)[0].token_ids) == 1
    reindexed = build_method("streaming_llm", 32, position_mode="reindex")
    out = Engine(model, reindexed, block_size=8, num_blocks=256).generate([list(range(5, 90))], max_new_tokens=1)
    assert out[0].finish_reason != "failed"


def test_a_sequence_whose_generation_or_scoring_passes_the_positions_is_refused():
    """The tokens a prompt may generate count (all but the last, which is never fed back), and the perplexity and
    multiple-choice scoring paths are checked too (they ran past the positions with status ok)."""
    from tests.tiny_models import tiny_model

    engine = Engine(tiny_model(max_positions=64), block_size=8, num_blocks=256)
    with pytest.raises(ValueError, match="a prompt of 50 tokens and 16 to generate pass the model's 64 positions"):
        engine.generate([list(range(5, 55))], max_new_tokens=16)
    assert len(engine.generate([list(range(5, 55))], max_new_tokens=15)[0].token_ids) <= 15  # 50 + 14 fed back
    with pytest.raises(ValueError, match="a prompt of 65 tokens passes the model's 64 positions"):
        engine.score(list(range(5, 70)))
    assert engine.score(list(range(5, 69))).numel() == 63
    from kvbench.runtime.serving.scoring import Scorer

    with pytest.raises(ValueError, match="a prompt of 65 tokens passes the model's 64 positions"):
        Scorer(engine).score_continuations(list(range(5, 60)), [list(range(11)), [7]])
    assert len(Scorer(engine).score_continuations(list(range(5, 60)), [list(range(10)), [7]])) == 2
