"""model.weights=quantized on small GGUF files (tests/fixtures/gguf_fixtures.write_gguf): the projections, the
embeddings and the tied head keep the file's blocks (runtime.model.quantized_weights), and the logits in prefill and
decode equal those of the same file de-quantized to fp32 (model.weights=dequantize) to 1e-3 relative; a type the
kernels lack is read de-quantized, and the one line says so."""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from kvbench.runtime.backends.cpu.linear import Linear
from kvbench.runtime.backends.cpu.quant_linear import QuantEmbedding, QuantLinear, load_quant_kernel
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.gguf_fixtures import GGUF_FAMILIES, GGUF_SETTINGS, write_gguf
from tests.runtime.test_architectures import kvbench_logits
from tests.tiny_models import tiny_hf_model

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(load_quant_kernel() is None, reason="no C compiler for the kernels")
PROMPT, DECODE = 40, 8


def _logits(loaded, ids):
    return kvbench_logits(Engine(loaded.model, prefill_chunk_size=16, block_size=8, num_blocks=256), ids, PROMPT,
                          chunk=16)


@pytest.mark.parametrize("family,quant", [("llama", "Q8_0"), ("tied", "Q4_0"), ("qwen2", "Q5_0"),
                                          ("gemma3", "Q8_0")])
def test_quantized_logits_equal_the_dequantized_run(family, quant, tmp_path, capsys):
    hf = tiny_hf_model(family, seed=3, vocab=320, qk_scale=3, **GGUF_SETTINGS.get(family, {}))
    path = write_gguf(hf, tmp_path / f"{family}.gguf", GGUF_FAMILIES[family], quant=quant)
    plain = load_model(str(path), cache_dir=tmp_path / "cache", weights="dequantize")
    kept = load_model(str(path), cache_dir=tmp_path / "cache", weights="quantized")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{family}.gguf: weights kept quantized ({quant}" in line or f"{quant})" in line, line
    lw = kept.model.layers[0]
    assert all(isinstance(lin, QuantLinear) for lin in (lw.qkv, lw.o, lw.gate_up, lw.down))
    assert isinstance(kept.model.embed, QuantEmbedding) and isinstance(kept.model.lm_head, QuantLinear)
    assert not isinstance(plain.model.layers[0].qkv, QuantLinear) and isinstance(plain.model.layers[0].qkv, Linear)
    assert kept.model.weight_bytes < plain.model.weight_bytes / 3
    ids = torch.randint(3, 320, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(2)).tolist()
    ref, got = _logits(plain, ids), _logits(kept, ids)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-3, err


def test_a_type_without_kernel_is_read_dequantized_and_named(tmp_path, capsys):
    hf = tiny_hf_model("qwen2", seed=3, vocab=320)
    path = write_gguf(hf, tmp_path / "q.gguf", "qwen2", quant="Q4_1")  # no kernel for Q4_1
    plain = load_model(str(path), cache_dir=tmp_path / "cache", weights="dequantize")
    kept = load_model(str(path), cache_dir=tmp_path / "cache", weights="quantized")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "weights kept quantized (none)" in line and "de-quantized to fp32 (no kernel for their blocks): " in line
    assert "Q4_1" in line and "\n" not in line
    assert not isinstance(kept.model.layers[0].qkv, QuantLinear)
    ids = torch.randint(3, 320, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(2)).tolist()
    assert torch.equal(_logits(plain, ids), _logits(kept, ids))


def test_bad_weights_value_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"invalid model.weights='int4': choices are quantized, dequantize"):
        load_model(None, weights="int4")


def test_kvquant_fingerprint_reads_the_blocks(tmp_path):
    """KVQuant's calibration cache key (quant.calibration.model_fingerprint) hashes a quantized model's blocks: the
    same file gives the same key, the de-quantized model another (its numbers differ in the last bits)."""
    from kvbench.quant.calibration import model_fingerprint

    hf = tiny_hf_model("qwen2", seed=3, vocab=320)
    path = write_gguf(hf, tmp_path / "q.gguf", "qwen2", quant="Q8_0")
    keys = [model_fingerprint(load_model(str(path), cache_dir=tmp_path / "cache", weights=w).model)
            for w in ("quantized", "quantized", "dequantize")]
    assert keys[0] == keys[1] != keys[2]
