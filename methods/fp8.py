"""`fp8`: the 8-bit baseline codec, fp8 e4m3 per token with one fp16 scale
per token (amax / 448), for keys and values alike.

No eviction: every token stays; every full block is stored packed (the newest, partly filled block in the model
dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

from methods.base import Method, register_method


@register_method("fp8")
@dataclass
class Fp8Cache(Method):
    def make_codec(self, model):
        from kvbench.quant.registry import build_codec

        return build_codec("fp8", model)
