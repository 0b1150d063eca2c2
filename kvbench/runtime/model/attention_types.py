"""Per-layer attention types: what one decoder layer's attention is, beyond plain causal softmax attention.

    LayerAttention(window=None, softcap=None, sinks=None)   one layer's type ("full" or "sliding(window)", with
                                                             learned sinks and score soft-capping where the model has
                                                             them)
    layer_types_from_hf(hf_config)                           the window of each layer from a transformers config
    VariantBackend(window, softcap, sinks)                   the attention backend of a layer with a variant

A sliding layer keeps a ring of the last `window` tokens in the pool (PagedKVCache.slide_window frees the blocks that
leave it) and is never compressed by a method: methods act on full layers only (as kvpress does for Gemma 3), so the
savings a method reports are its own. A layer with any variant attends through the torch reference
(`paged_attention_torch`'s window / sinks / softcap): the CPU and Triton kernels have none of them yet
(docs/runtime.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from kvbench.runtime.backends.base import AttentionBackend
from kvbench.runtime.backends.torch.attention import paged_attention_torch

# transformers' layer_types values kvbench honours: a full causal layer, a sliding-window one
FULL, SLIDING = "full_attention", "sliding_attention"
HONOURED_LAYER_TYPES = (FULL, SLIDING)
# model types whose config has no layer_types and whose `sliding_window` (when set) applies to every layer
WINDOW_ON_EVERY_LAYER = ("mistral", "phi3")
# model types whose transformers attention reads `layer_types` (transformers 5: Qwen2/3, Gemma 2/3, GPT-OSS); the
# others' classes ignore the key (Llama and DeepSeek-V2 have no sliding layers, Mistral and Phi-3 slide every layer
# by `sliding_window`), so a config.json that carries it runs as transformers runs it: without it
LAYER_TYPES_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "gpt_oss")


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention type. window: keys at positions > p - window are visible to the query at p (None:
    every earlier key); softcap: scores -> softcap * tanh(scores / softcap); sinks: a learned logit per query head
    [Hq] joins the softmax (held in the layer's weights, LayerWeights.sinks)."""

    window: Optional[int] = None
    softcap: Optional[float] = None
    has_sinks: bool = False

    @property
    def kind(self) -> str:
        """"full" or "sliding" (the split of metrics.json's KV bytes)."""
        return "full" if self.window is None else "sliding"

    def describe(self) -> str:
        """'full' or 'sliding(4096)', '+sinks' where the layer has them."""
        base = "full" if self.window is None else f"sliding({self.window})"
        return base + ("+sinks" if self.has_sinks else "")

    @property
    def plain(self) -> bool:
        """True for plain causal attention (every backend's kernels)."""
        return self.window is None and self.softcap is None and not self.has_sinks


def layer_windows_from_hf(hc: Any) -> list[Optional[int]]:
    """The window of each of a transformers config's layers (None: full attention), as its eager forward applies
    them: `layer_types` where the config has them and the family's transformers class reads them
    (LAYER_TYPES_FAMILIES; sliding_attention -> sliding_window), else Mistral's or Phi-3's `sliding_window` on every
    layer (its v0.1 configs), else none. ValueError for a layer type kvbench cannot honour (chunked attention, ...)."""
    L = hc.num_hidden_layers
    window = getattr(hc, "sliding_window", None)
    types = getattr(hc, "layer_types", None) if getattr(hc, "model_type", None) in LAYER_TYPES_FAMILIES else None
    if types:
        bad = sorted({t for t in types if t not in HONOURED_LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types {bad} are not honoured; kvbench runs {', '.join(HONOURED_LAYER_TYPES)}")
        if SLIDING in types and not (isinstance(window, int) and window >= 1):
            raise ValueError(f"sliding layer_types with sliding_window={window!r}: expected a positive integer")
        return [window if t == SLIDING else None for t in types[:L]]
    if getattr(hc, "model_type", None) in WINDOW_ON_EVERY_LAYER and window is not None:
        return [int(window)] * L
    return [None] * L


class VariantBackend(AttentionBackend):
    """The attention of a layer with a window, sinks or soft-capping: the torch reference with them (no fused or
    packed kernel)."""

    name = "torch"

    def __init__(self, window: Optional[int], softcap: Optional[float], sinks: Optional[torch.Tensor]):
        self.window, self.softcap, self.sinks = window, softcap, sinks

    def attend(self, q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale, *,
               return_key_scores=False, rotate_keys=None, causal=True):
        return paged_attention_torch(q, k_pool, v_pool, tables, lengths, key_positions, query_positions, scale,
                                     return_key_scores=return_key_scores, rotate_keys=rotate_keys, causal=causal,
                                     window=self.window, sinks=self.sinks, softcap=self.softcap)
