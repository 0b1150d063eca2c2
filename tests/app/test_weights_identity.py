"""model.weights in a run's identity (spec.hashable_config): `quantized` of a GGUF is another run than its
`dequantize`; `dequantize` hashes as the runs before the option existed, and a checkpoint that is not a GGUF hashes
alike either way (the option changes nothing there)."""
from __future__ import annotations

from omegaconf import OmegaConf

from kvbench.run.spec import hashable_config


def _hashed(model: dict) -> dict:
    root = OmegaConf.create({"model": model, "method": {"name": "full"}, "budget": None, "seed": 0})
    return hashable_config(root)["model"]


def test_weights_hashed_only_where_they_change_the_numbers(tmp_path):
    gguf = {"name": "gemma-3-270m", "path": "packaged:gemma-3-270m", "gguf_file": None}
    assert _hashed({**gguf, "weights": "quantized"}) != _hashed({**gguf, "weights": "dequantize"})
    assert _hashed({**gguf, "weights": "dequantize"}) == _hashed(gguf)  # as before the option
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    plain = {"name": None, "path": str(folder), "gguf_file": None}
    assert _hashed({**plain, "weights": "quantized"}) == _hashed(plain)
    (folder / "m.gguf").write_bytes(b"GGUF")  # a folder holding a GGUF: the option matters
    assert _hashed({**plain, "weights": "quantized"}) != _hashed(plain)


def test_quant_activations_hashed_only_when_q8_on_weights_kept_quantized(tmp_path):
    """model.quant_activations=fp32 (the default) hashes as the runs before the option; q8 of a GGUF kept quantized
    is another run; q8 where the weights are fp32 changes nothing and hashes alike."""
    gguf = {"name": "gemma-3-270m", "path": "packaged:gemma-3-270m", "gguf_file": None, "weights": "quantized"}
    assert _hashed({**gguf, "quant_activations": "fp32"}) == _hashed(gguf)
    assert _hashed({**gguf, "quant_activations": "q8"}) != _hashed(gguf)
    plain = {**gguf, "weights": "dequantize"}
    assert _hashed({**plain, "quant_activations": "q8"}) == _hashed(plain)
