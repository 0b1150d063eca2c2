"""`pyramidkv`: PyramidKV (Cai et al., 2024, arXiv 2406.02069; official code Zefan-Cai/KVCache-Factory; kvpress
`PyramidKVPress`): SnapKV's scores with per-layer budgets in a pyramid, more tokens in lower layers.

For a prompt of T tokens and the average budget B (`budget`, tokens per layer and kv-head), kvpress's allocation
(its `get_layer_budget`, with kvpress's T*(1 - compression_ratio) replaced by B):
    min = B / beta, max = 2B - min; if max >= T - window: max = T - window, min = 2B - max;
    if not (T >= max >= min >= window): every layer keeps B (SnapKV);
    else layer l of L keeps max - l * (max - min) / (L - 1) tokens (the observation window included).
The layer budgets sum to L * B: each is rounded down and the leftover tokens go to the largest remainders (kvpress
rounds each layer on its own, which equals this except at exact .5 ties and may then miss L * B by a token or two).
A prompt of at most B tokens is not compressed. The tokens of each layer are SnapKV's (`snapkv`): the last `window`
prompt queries' attention, pooled (`kernel_size`, `pooling`), top per kv-head plus the window. Every table of a layer
is cut to the layer's budget, so upper layers really free their blocks. Defaults are kvpress's: window 64, kernel 5,
avgpool, beta 20 (with them, budgets below 20 * 64 = 1280 tokens fall back to SnapKV, as in kvpress). The prompt is
compressed once (decode="none"), as in the paper and kvpress.

Per-layer budgets are a wrapper (methods/wrappers.py): `method.base` takes any plain scorer (`method=pyramidkv
method.base=knorm`, its options under `method.base_options`); the pyramid's window is then the base's observation
window (`query_window`) or else its recent window. `window`, `kernel_size` and `pooling` are the SnapKV base's
options (the default base), kept here as kvpress's PyramidKVPress has them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kvbench.methods.base import register_method
from kvbench.methods.checks import check_choice, check_int
from kvbench.methods.observers import POOLINGS
from kvbench.methods.selection import top_tokens
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation


def pyramid_budgets(budget: int, n_tokens: int, num_layers: int, window: int, beta: int) -> list[int]:
    """Tokens kept per layer (index 0 = lowest) for a prompt of n_tokens and an average budget; sums to
    num_layers * budget (n_tokens per layer when the prompt fits the budget)."""
    L = num_layers
    if n_tokens <= budget:
        return [n_tokens] * L
    lo = budget / beta
    hi = 2 * budget - lo
    if hi >= n_tokens - window:
        hi = n_tokens - window
        lo = 2 * budget - hi
    if L == 1 or not (n_tokens >= hi >= lo >= window):
        return [budget] * L  # kvpress falls back to SnapKV's uniform budget
    step = (hi - lo) / (L - 1)
    raw = [hi - layer * step for layer in range(L)]
    out = [int(r) for r in raw]  # floor (all positive)
    by_remainder = sorted(range(L), key=lambda layer: (-(raw[layer] - out[layer]), layer))
    for layer in by_remainder[: L * budget - sum(out)]:
        out[layer] += 1
    return out


@register_method("pyramidkv")
@dataclass
class PyramidKV(ScorerWrapper):
    """A scorer's selection (SnapKV's by default) with a pyramid of per-layer budgets (average `budget`)."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    reselects_by_score: ClassVar[bool] = False  # its own selection (no decode="interval")
    decode: str = "none"
    base: str = "snapkv"
    window: int = 64
    kernel_size: int = 5
    pooling: str = "avgpool"
    beta: int = 20

    def __post_init__(self) -> None:
        check_int(self.name, "beta", self.beta, 1)
        if self.base_name() == "snapkv":  # the default base takes its options from here (kvpress's PyramidKVPress)
            check_int(self.name, "window", self.window, 1)
            check_int(self.name, "kernel_size", self.kernel_size, 1)
            check_choice(self.name, "pooling", self.pooling, POOLINGS)
            if isinstance(self.base_options, dict):
                self.base_options = {"window": self.window, "kernel_size": self.kernel_size, "pooling": self.pooling,
                                     **self.base_options}
        super().__post_init__()

    def pyramid_window(self, budget: int) -> int:
        """The window the pyramid's allocation keeps out of the budgets: the base's observation window (SnapKV's
        `window`), else its recent window."""
        return self.inner.query_window or self.inner.recent_window(budget)

    def layer_budget(self, layer: int, n_tokens: int, budget: int | None = None) -> int:
        """Tokens layer `layer` keeps per kv-head once a prompt of n_tokens is compressed (average `budget`, by
        default the configured one)."""
        L = self.model_config.num_layers
        budget = self.budget if budget is None else budget
        return pyramid_budgets(budget, n_tokens, L, self.pyramid_window(budget), self.beta)[layer]

    def table_budget(self, layer: int, head: int) -> int | None:
        """The most tokens a table of `layer` holds for any prompt length: the uncapped pyramid's value for the layer
        (rounded up) or `budget`, whichever is larger (capping at T - window flattens the pyramid towards budget)."""
        if self.budget is None:
            return None
        B, L = self.budget, self.model_config.num_layers
        lo = B / self.beta
        hi = 2 * B - lo
        if L == 1 or not hi >= lo >= self.pyramid_window(B):
            return B
        return max(B, math.ceil(hi - layer * (hi - lo) / (L - 1)))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        lengths = obs.lengths  # [H]
        b = self.layer_budget(obs.layer, obs.tokens_seen, budget)
        if int(lengths.max()) > b:
            scores = self.score(obs)  # [H, T] the base's (SnapKV's: the window's own columns +inf)
            self.keep(obs, top_tokens(scores, b, lengths, recent=min(self.inner.recent_window(b), b)))
