"""Issue 66 item 1: any GGUF of the families kvbench runs loads through `model.path=<file.gguf>` (or a folder holding
one), read as transformers' GGUF reader reads it.

On small synthetic GGUF files (tests/fixtures/gguf_fixtures.write_gguf, Q8_0 weights) of each family:
  * the header read as a config (gguf_config.hf_config_from_gguf) equals transformers' load_gguf_checkpoint's config;
  * kvbench's model (loaded from the file, converted once into the cache) gives transformers' logits on the same file
    to 1e-4 in prefill and decode, and its layer types (Gemma 3's five local layers per global one, which the file
    does not hold) are the ones model_info reads from the header;
  * a folder holding one GGUF loads as that file; several are refused in one line; an architecture transformers'
    reader lacks (deepseek2) is refused in one line by the checks and `kvbench-info`.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvbench.errors import UserError
from kvbench.commands.info import main as info_main
from kvbench.run.model_info import check_runnable, model_shape
from kvbench.runtime.model.gguf_config import hf_config_from_gguf
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.model.model_files import check_model_path, read_gguf_header, resolve_location
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.gguf_fixtures import GGUF_FAMILIES, GGUF_SETTINGS, gguf_hf_model, header_only_gguf, write_gguf
from tests.runtime.test_architectures import hf_logits, kvbench_logits
from tests.tiny_models import tiny_hf_model

PROMPT, DECODE = 40, 8


def _tiny_gguf(family: str, folder, quant: str | None = "Q8_0"):
    hf = tiny_hf_model(family, seed=3, vocab=320, qk_scale=3, **GGUF_SETTINGS.get(family, {}))
    return write_gguf(hf, folder / f"{family}.gguf", GGUF_FAMILIES[family], quant=quant)


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_gguf_family_loads_as_transformers_reads_it(family, tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _tiny_gguf(family, tmp_path / "files")
    ours = hf_config_from_gguf(read_gguf_header(str(path), "test"))
    theirs = load_gguf_checkpoint(str(path))["config"]
    for key in ("tie_word_embeddings", "vocab_size"):  # from the tensors and the token list: not read from a header
        theirs.pop(key, None)
    assert {k: v for k, v in ours.items() if k != "vocab_size"} == theirs

    check_runnable(SimpleNamespace(path=str(path), gguf_file=None))
    loaded = load_model(str(path), cache_dir=tmp_path / "cache")
    ref_model = gguf_hf_model(path)
    ids = torch.randint(3, 320, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = hf_logits(ref_model, ids)
    got = kvbench_logits(Engine(loaded.model, prefill_chunk_size=16, block_size=8, num_blocks=256), ids, PROMPT,
                         chunk=16)
    assert (got - ref).abs().max().item() <= 1e-4
    shape = model_shape(SimpleNamespace(path=str(path), gguf_file=None))
    windows = tuple(loaded.model.config.layer_windows)
    assert shape.model_type == ref_model.config.model_type
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (
        loaded.model.config.num_layers, loaded.model.config.num_kv_heads, loaded.model.config.head_dim)
    assert shape.layer_windows == (windows if any(w is not None for w in windows) else ())
    if family == "gemma3":  # the file has no layer pattern: transformers' default, five local per global
        assert windows == (24,) * 5 + (None, 24)


def test_gemma3_global_rope_scaling_is_read_back_from_the_header(tmp_path):
    """Gemma 3 4B+ scale their global layers' RoPE linearly by 8; llama.cpp writes gemma3.rope.scaling.*, which
    transformers' reader drops. kvbench restores it: its logits equal the original model's, transformers' own load
    of the file differs (so the check can fail)."""
    settings = dict(GGUF_SETTINGS["gemma3"])
    settings["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}
    original = tiny_hf_model("gemma3", seed=3, vocab=320, qk_scale=3, **settings)
    path = write_gguf(original, tmp_path / "g.gguf", "gemma3")
    loaded = load_model(str(path), cache_dir=tmp_path / "cache")
    ids = torch.randint(3, 320, (PROMPT,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = hf_logits(original, ids)
    got = kvbench_logits(Engine(loaded.model, prefill_chunk_size=16, block_size=8, num_blocks=256), ids, PROMPT,
                         chunk=16)
    assert (got - ref).abs().max().item() <= 1e-4
    assert (hf_logits(gguf_hf_model(path), ids) - ref).abs().max().item() > 1e-3  # transformers alone: unscaled


def test_folder_holding_one_gguf_loads_it_and_several_are_refused(tmp_path):
    path = _tiny_gguf("qwen2", tmp_path / "one", quant=None)
    folder = str(path.parent)
    assert resolve_location(folder, None) == (folder, "qwen2.gguf")
    check_model_path(folder)
    assert model_shape(SimpleNamespace(path=folder, gguf_file=None)).model_type == "qwen2"
    loaded = load_model(folder, cache_dir=tmp_path / "cache")
    assert loaded.model.config.model_type == "qwen2"
    _tiny_gguf("llama", tmp_path / "one", quant=None)
    with pytest.raises(UserError) as info:
        check_model_path(folder)
    assert "several .gguf files (llama.gguf, qwen2.gguf)" in str(info.value) and "\n" not in str(info.value)


def test_gguf_missing_a_tensor_is_refused_not_filled_with_random_weights(tmp_path):
    hf = tiny_hf_model("qwen2", seed=3, vocab=320)
    path = write_gguf(hf, tmp_path / "m.gguf", "qwen2", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(UserError) as info:
        load_model(str(path), cache_dir=tmp_path / "cache")
    msg = str(info.value)
    assert "do not match its header" in msg and "model.layers.1.mlp.up_proj.weight" in msg and "\n" not in msg
    assert not list((tmp_path / "cache" / "gguf").glob("m-*/done"))  # nothing cached


def test_unsupported_gguf_architecture_is_refused_in_one_line(tmp_path, capsys):
    path = str(header_only_gguf(tmp_path / "ds.gguf", "deepseek2"))
    with pytest.raises(UserError) as info:
        check_runnable(SimpleNamespace(path=path, gguf_file=None))
    assert "unsupported GGUF architecture 'deepseek2'" in str(info.value) and "gemma3" in str(info.value)
    assert model_shape(SimpleNamespace(path=path, gguf_file=None)) is None  # no Llama guessed from the header
    assert info_main([path]) == 2
    err = capsys.readouterr().err.strip()
    assert "unsupported GGUF architecture 'deepseek2'" in err and "\n" not in err


def test_kvbench_info_reads_a_gemma3_gguf_layer_types(tmp_path, capsys):
    path = _tiny_gguf("gemma3", tmp_path, quant=None)
    assert info_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "model_type: gemma3_text" in out and "layers: 7 (1 full, 6 sliding)" in out
    assert "layer types: " + ", ".join(["sliding(24)"] * 5 + ["full", "sliding(24)"]) in out
