"""`int8`: the 8-bit baseline codec, int8 per token, symmetric (absmax / 127),
one fp16 scale per token, for keys and values alike.

No eviction: every token stays; every full block is stored packed (the newest, partly filled block in the model
dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

from methods.base import Method, register_method


@register_method("int8")
@dataclass
class Int8Cache(Method):
    def make_codec(self, model):
        from kvbench.quant.registry import build_codec

        return build_codec("int8", model)
