"""`kvquant` (Hooper et al., NeurIPS 2024): nuqX keys per channel before RoPE, values per token, 1% outliers.

No eviction: every token stays; full blocks are stored packed by `kvbench.quant.codecs.KVQuantCodec` (the block
holding the first token in fp16). Levels per layer and key thresholds per channel come from a calibration pass
over text kept apart from the evaluation text (`kvbench.quant.calibration`; cached on disk). `levels=uniform`
with `outlier_fraction=0` is the paper's intX ablation.
"""
from __future__ import annotations

from dataclasses import dataclass

from methods.base import Method, register_method


@register_method("kvquant")
@dataclass
class KVQuant(Method):
    bits: int = 3
    outlier_fraction: float = 0.01
    levels: str = "nuq"  # nuq | uniform
    calibration: str = "fisher"  # fisher (sensitivity-weighted k-means) | kmeans
    key_ranges: str = "calibrated"  # calibrated (offline per-channel thresholds) | online (per block, stored)
    calibration_corpus: str = "aclsum_train"
    calibration_sequences: int = 4
    calibration_tokens: int = 1024

    def __post_init__(self) -> None:
        super().__post_init__()
        from kvbench.quant.registry import kvquant_settings

        kvquant_settings(self._options())  # validates (UserError); calibration itself waits for make_codec

    def _options(self) -> dict:
        return dict(bits=self.bits, outlier_fraction=self.outlier_fraction, levels=self.levels,
                    calibration=self.calibration, key_ranges=self.key_ranges,
                    calibration_corpus=self.calibration_corpus, calibration_sequences=self.calibration_sequences,
                    calibration_tokens=self.calibration_tokens)

    def make_codec(self, model):
        from kvbench.quant.registry import build_codec

        return build_codec("kvquant", model, **self._options())
