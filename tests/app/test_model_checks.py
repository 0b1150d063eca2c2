"""Issue 56, item 2: a model kvbench cannot run as its files describe it is refused before the weights load, in one
line (kvbench.run.model_checks): weights that do not match config.json (missing, unexpected, mismatched tensors, named),
configs of other model types, custom code, impossible sizes, a window that cannot be honoured (issue 60 honours sliding
windows: Mistral's, Gemma's, Qwen2's layer_types). Every supported family passes.
The CLI cases (exit 2, no run folder) are rows of tests/app/test_bad_input.py."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from kvbench.errors import UserError
from kvbench.run.model_checks import check_config, loading_report
from kvbench.run.model_info import check_runnable
from kvbench.runtime.model.loading import load_hf
from kvbench.runtime.model.forward import SUPPORTED_MODEL_TYPES
from tests.tiny_models import ARCH_FAMILIES, FAMILIES, tiny_hf_model

TOKENIZER = '{"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}'


def save(model, folder):
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(TOKENIZER)
    return folder


def edit(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def refusal(folder) -> str:
    with pytest.raises(UserError) as info:
        check_runnable(SimpleNamespace(path=str(folder), gguf_file=None))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"model.path={str(folder)!r}")
    return message


@pytest.mark.parametrize("family", FAMILIES + ARCH_FAMILIES)
def test_every_supported_family_passes(tmp_path, family):
    folder = save(tiny_hf_model(family, layers=2), tmp_path / family)
    check_runnable(SimpleNamespace(path=str(folder), gguf_file=None))


def test_weights_of_fewer_layers_than_the_config_are_refused_naming_them(tmp_path, monkeypatch):
    # the case: config.json says more layers than the checkpoint holds (transformers would add random ones)
    folder = save(tiny_hf_model("llama", layers=2), tmp_path / "m")
    edit(folder, num_hidden_layers=3)
    message = refusal(folder)
    assert "missing 9 tensors: model.layers.2.input_layernorm.weight" in message, message
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())  # no real one here
    with pytest.raises(UserError, match="missing 9 tensors"):  # the loader's own report refuses them too
        load_hf(str(folder))
    edit(folder, num_hidden_layers=2)
    hf, _ = load_hf(str(folder))  # the matching checkpoint loads
    assert len(hf.model.layers) == 2


def test_unexpected_and_mismatched_tensors_are_refused(tmp_path):
    folder = save(tiny_hf_model("llama", layers=3), tmp_path / "more")
    edit(folder, num_hidden_layers=2)
    assert "unexpected 9 tensors: model.layers.2." in refusal(folder)
    folder = save(tiny_hf_model("llama", layers=2), tmp_path / "vocab")
    edit(folder, vocab_size=400)
    message = refusal(folder)
    assert "mismatched 2 tensors: lm_head.weight [320, 64] vs [400, 64], model.embed_tokens.weight" in message


def test_a_tied_checkpoint_without_lm_head_passes(tmp_path):
    folder = save(tiny_hf_model("tied", layers=2), tmp_path / "tied")
    from kvbench.run.model_checks import safetensors_shapes

    assert "lm_head.weight" not in safetensors_shapes(str(folder))
    check_runnable(SimpleNamespace(path=str(folder), gguf_file=None))


GOOD = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 64, "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 512}


@pytest.mark.parametrize("changes,needle", [
    ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
    ({"model_type": None}, "unsupported model_type None"),
    ({"num_key_value_heads": 0}, "invalid num_key_value_heads=0"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 in config.json is not a multiple of num_key_value_heads=3"),
    ({"max_position_embeddings": -1}, "invalid max_position_embeddings=-1"),
    ({"num_hidden_layers": 2.5}, "invalid num_hidden_layers=2.5"),
    ({"hidden_size": 66}, "hidden_size=66 in config.json is not divisible by num_attention_heads=4"),
    ({"hidden_size": 66, "head_dim": 16}, "honoured for mistral, qwen3, gemma2, gemma3_text, gemma3, gpt_oss only"),
    ({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "custom code"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"model_type": "mistral", "sliding_window": 0}, "invalid sliding_window=0"),
    ({"model_type": "mistral", "sliding_window": "4k"}, "invalid sliding_window='4k'"),
    ({"model_type": "qwen2", "sliding_window": None, "use_sliding_window": True}, "invalid sliding_window=None"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types ['chunked_attention'] in config.json cannot be honoured"),
    ({"model_type": "gemma3_text", "head_dim": 16, "use_bidirectional_attention": True}, "use_bidirectional"),
    ({"model_type": "gemma2", "hidden_activation": "gelu"}, "hidden_activation='gelu'"),
])
def test_configs_kvbench_cannot_run_are_refused(changes, needle):
    with pytest.raises(UserError) as info:
        check_config({**GOOD, **changes}, "model.path='m'", SUPPORTED_MODEL_TYPES)
    assert needle in str(info.value) and str(info.value).startswith("model.path='m': ")


def test_configs_it_can_run_pass():
    check_config(GOOD, "w", SUPPORTED_MODEL_TYPES)
    check_config({**GOOD, "model_type": "mistral", "sliding_window": None}, "w", SUPPORTED_MODEL_TYPES)
    # issue 60: windows are honoured (Mistral's on every layer, layer_types, Qwen2's use_sliding_window)
    check_config({**GOOD, "model_type": "mistral", "sliding_window": 4096}, "w", SUPPORTED_MODEL_TYPES)
    check_config({**GOOD, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, "w",
                 SUPPORTED_MODEL_TYPES)
    check_config({**GOOD, "model_type": "qwen3", "sliding_window": 64,
                  "layer_types": ["full_attention", "sliding_attention"]}, "w", SUPPORTED_MODEL_TYPES)
    check_config({**GOOD, "model_type": "gemma3_text", "head_dim": 256, "sliding_window": 512,
                  "hidden_activation": "gelu_pytorch_tanh"}, "w", SUPPORTED_MODEL_TYPES)
    check_config({"model_type": "gemma3", "text_config": {**GOOD, "model_type": "gemma3_text", "sliding_window": 1024,
                                                          "hidden_activation": "gelu_pytorch_tanh"}},
                 "w", SUPPORTED_MODEL_TYPES)  # a multimodal checkpoint: its text_config is checked
    check_config({**GOOD, "model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}, "w",
                 SUPPORTED_MODEL_TYPES)  # Qwen2.5's configs: a window that is not used
    check_config({**GOOD, "model_type": "qwen3", "hidden_size": 66, "head_dim": 16}, "w", SUPPORTED_MODEL_TYPES)
    check_config({**GOOD, "num_key_value_heads": None, "max_position_embeddings": None}, "w", SUPPORTED_MODEL_TYPES)


def test_loading_report_names_what_transformers_found():
    assert loading_report({"missing_keys": set(), "unexpected_keys": [], "mismatched_keys": []}, "m") is None
    line = loading_report({"missing_keys": {"model.layers.3.a", "model.layers.4.a"}, "unexpected_keys": ["x"],
                           "mismatched_keys": [("w", torch.Size([2]), torch.Size([3]))]}, "model 'p'")
    assert line.startswith("model 'p': its weights do not match its config.json (missing 2 tensors: "
                           "model.layers.3.a, model.layers.4.a (layers 3-4); unexpected 1 tensor: x; "
                           "mismatched 1 tensor: w torch.Size([2]) torch.Size([3]))")


def test_reading_a_longrope_config_prints_none_of_transformers_notes(capsys, caplog):
    """kvbench's checks read a config through transformers (the layer windows): the library's one-time advice on a
    longrope config must not reach the console, or a bad-input error is two lines in a fresh process."""
    import transformers.utils.logging as transformers_logging

    from kvbench.run.model_info import _layer_windows

    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
           "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 4096,
           "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                               "long_factor": [4.0] * 8, "original_max_position_embeddings": 256}}
    transformers_logging.warning_once.cache_clear()  # as in a fresh process: the note has not been printed yet
    assert _layer_windows(cfg) == ()
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    assert not [r for r in caplog.records if r.name.startswith("transformers")]


def test_checking_a_longrope_folders_weights_prints_none_of_transformers_notes(tmp_path, capsys, caplog):
    """check_weights builds the model its config.json describes (expected_shapes): in a fresh process the longrope
    advice came out there, a second stderr line before kvbench's one-line refusal."""
    import json

    import transformers.utils.logging as transformers_logging

    from kvbench.run.model_checks import expected_shapes
    from tests.tiny_models import tiny_hf_model

    tiny_hf_model("llama", layers=2).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [4.0] * 8, "original_max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    transformers_logging.warning_once.cache_clear()  # as in a fresh process
    capsys.readouterr()  # save_pretrained's progress bar
    caplog.clear()
    shapes, _, _ = expected_shapes(str(tmp_path))
    assert shapes
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    assert not [r for r in caplog.records if r.name.startswith("transformers")]
