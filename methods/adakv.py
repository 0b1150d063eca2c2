"""`adakv`: Ada-KV (Feng et al., 2024, arXiv:2407.11550), head-adaptive budgets over any scoring method.

`method=adakv method.base=snapkv` (the base's options under `method.base_options`, added on the command line
with `+method.base_options.window=32`): the base scores every cached token per kv-head as it would alone; instead of each kv-head keeping its own top `budget`, a layer keeps the
kv_heads x budget best (kv-head, token) pairs chosen jointly over its kv-heads, so heads that concentrate their
attention give budget to heads that spread it. Ada-KV's safeguard: each kv-head first keeps its
int(alpha_safeguard x budget) best tokens (kvpress AdaKVPress, alpha_safeguard 0.20), and the base's recent
window (SnapKV's observation window, H2O's recent tokens) stays in every head.

The recent window is kept in every head as kvpress keeps SnapKV's (it pads the window with the largest score + 1).
Nothing else is protected at prefill, as in kvpress: over a windowless base (expected_attention, knorm, random) the
prompt's last token stays in a head only if it scores high enough (ScorerWrapper.recent_kept), as in kvpress.

Where kvpress masks the dropped pairs with fake keys (nothing freed), kvbench's per-(layer, kv-head) tables really
hold different numbers of tokens: a head keeping fewer tokens holds fewer blocks, and the pool gets the rest back.
Decoding (`decode`): "none" (default, the paper and kvpress: the prompt is compressed once; generated tokens are
appended) or "evict" (the joint selection runs again whenever a layer exceeds kv_heads x budget).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_float
from kvbench.methods.wrappers import ScorerWrapper


@register_method("adakv")
@dataclass
class AdaKV(ScorerWrapper):
    """The base's scores; a layer's kv_heads x budget tokens allocated across its kv-heads jointly."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows
    head_adaptive: ClassVar[bool] = True  # the layer's kv_heads x budget best (kv-head, token) pairs

    alpha_safeguard: float = 0.20

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float(self.name, "alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)

    def min_tokens_per_head(self, budget: int) -> int:
        return int(budget * self.alpha_safeguard)  # kvpress: int(n_kept * alpha_safeguard)
