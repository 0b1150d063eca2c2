"""When one forward step calls the method's hooks (kvbench.runtime.hooks): before a prefill chunk's attention,
after each layer's attention, or, for a decode hook that reads only the cache, once per layer after the whole step.

    hooks = StepHooks.of(method, cache, rotary)   # per step; method None: no hook
    hooks.before_attention(li, group, q)           # prefill, acts_before_attention: the chunk attends to what stays
    hooks.after_attention(li, group, q, key_scores, hidden)
    hooks.after_step(group, num_layers)            # decode_reads_attention = False: every layer after the step

The model forward (runtime.model.forward) decides where in a layer these calls fall; this module decides whether a
call is due and builds the LayerContext the method sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvbench.runtime.hooks import LayerContext, NoCompression, declared

if TYPE_CHECKING:  # annotations only
    from kvbench.runtime.model.rope import RotaryTable

# a group of the step (runtime.model.forward.RaggedGroup: tokens [S, Q], plan, phase, last_chunk); named loosely,
# as the forward imports this module
RaggedGroup = Any


@dataclass
class StepHooks:
    """The method's hooks for one step over `cache` (method None: the step calls none)."""

    method: NoCompression | None
    cache: Any
    rotary: RotaryTable

    @classmethod
    def of(cls, hook: Any, cache: Any, rotary: RotaryTable) -> "StepHooks":
        return cls(None if hook is None else declared(hook), cache, rotary)

    @property
    def active(self) -> bool:
        return self.method is not None

    @property
    def need_scores(self) -> bool:
        """Attention returns per-key attention mass [S, H, T] for the hook."""
        return self.method is not None and bool(self.method.needs_key_scores)

    @property
    def reads_hidden(self) -> bool:
        """The hook reads each layer's attention input (ctx.hidden): no fused layers, no captured graphs."""
        return self.method is not None and bool(self.method.reads_hidden_states)

    def acts_before(self, group: RaggedGroup) -> bool:
        """A before_attention call is due in this group's steps (prefill chunks only)."""
        return self.method is not None and group.phase == "prefill" and bool(self.method.acts_before_attention)

    def fusable(self, groups: list[RaggedGroup]) -> bool:
        """Whether the hooks allow whole layers per kernel call (the backend's fused decode): one group, no
        before_attention call in it and no per-layer attention input read."""
        return len(groups) == 1 and not self.acts_before(groups[0]) and not self.reads_hidden

    def cache_only(self, group: RaggedGroup) -> bool:
        """A decode hook that reads only the cache (decode_reads_attention = False, no key scores): called for each
        layer after the whole step (a layer's cache is not read again in its step: the same result)."""
        return (self.method is not None and group.phase == "decode" and not self.need_scores
                and not self.method.decode_reads_attention)

    def before_attention(self, layer: int, group: RaggedGroup, q: torch.Tensor | None) -> None:
        """The method cuts the layer's K/V (written) before its attention, q [S, Hq, Q, D]: the chunk attends to what
        it keeps (the plan's layer is read again)."""
        if self.acts_before(group):
            self.method.before_attention(LayerContext(layer, self.cache, group.plan, group.phase, group.last_chunk, q,
                                                      None, self.rotary))
            self.cache.refresh_plan_layer(group.plan, layer)

    def after_attention(self, layer: int, group: RaggedGroup, q: torch.Tensor | None,
                        key_scores: torch.Tensor | None, hidden: torch.Tensor | None = None) -> None:
        """After the layer's attention: q [S, Hq, Q, D], key_scores [S, H, T] (when asked), hidden [S, Q, E]."""
        if self.method is not None:
            self.method.after_attention(LayerContext(layer, self.cache, group.plan, group.phase, group.last_chunk, q,
                                                     key_scores, self.rotary, hidden))

    def per_layer(self, group: RaggedGroup) -> Callable[[int, torch.Tensor, torch.Tensor | None], None] | None:
        """What a fused step calls after each layer (li, q, key_scores), or None: no hook during the step (none at
        all, or a cache-only decode hook that after_step calls)."""
        if self.method is None or self.cache_only(group):
            return None
        return lambda li, q, key_scores: self.after_attention(li, group, q, key_scores)

    def after_step(self, group: RaggedGroup, num_layers: int) -> None:
        """A cache-only decode hook, for each layer after the whole step (ctx.q and key_scores None)."""
        if self.cache_only(group):
            for li in range(num_layers):
                self.after_attention(li, group, None, None)


def no_hooks(cache: Any, rotary: RotaryTable) -> StepHooks:
    """The hooks of a layer the method does not see (a sliding-window layer): none."""
    return StepHooks(None, cache, rotary)
