"""`kivi` (Liu et al., ICML 2024): 2/4-bit asymmetric KV quantization, keys per channel, values per token.

No eviction: every token stays, old blocks are stored packed by `kvbench.quant.codecs.KiviCodec` (the newest
`residual` tokens in fp16). `key_axis=token` quantizes keys per token instead (the paper's ablation).
"""
from __future__ import annotations

from dataclasses import dataclass

from methods.base import Method, register_method


@register_method("kivi")
@dataclass
class Kivi(Method):
    bits: int = 2
    group_size: int = 32  # G: tokens per key group (per channel), channels per value group (per token)
    residual: int = 128  # R: newest tokens kept in full precision (R % G == 0)
    key_axis: str = "channel"  # channel | token

    def __post_init__(self) -> None:
        super().__post_init__()
        self.make_codec(None)  # validates the settings (UserError naming the bad value)

    def make_codec(self, model):
        from kvbench.quant.registry import build_codec

        return build_codec("kivi", model, bits=self.bits, group_size=self.group_size, residual=self.residual,
                           key_axis=self.key_axis)
