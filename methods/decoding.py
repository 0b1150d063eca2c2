"""`decoding`: compression while decoding only, every `compression_interval` steps, over any scorer (kvpress
`DecodingPress(base_press)`; its registry rows decoding_knorm, decoding_tova, decoding_qfilter, decoding_keydiff,
decoding_adakv_snapkv, decoding_adakv_expected_attention_e2).

The prompt is not compressed. While decoding, each layer counts its decode steps; at every `compression_interval`-th
step (kvpress's default 512) a table holding more than the budget (kvpress's `target_size`, default 2048) is brought
back to it (kvbench's one periodic policy, EvictionMethod.evict_every, is this one): each kv-head keeps its
budget best tokens by the base's scores (`head_adaptive=false`, kvpress DecodingPress(ScorerPress)), or the layer keeps its kv_heads x budget best (kv-head, token) pairs jointly
(`head_adaptive=true`, DecodingPress(AdaKVPress(...)), with Ada-KV's alpha_safeguard). As in kvpress, tokens are
ranked by score alone (the base's own window aside, e.g. SnapKV's): the newest token is not protected. The base
observes every decode step (its query window, accumulated attention or per-token scores), so at a compression it
scores from the latest generated tokens, as kvpress's buffer of the last `hidden_states_buffer_size` (256) hidden
states does for the window-based scorers (SnapKV's 64, TOVA's 1). Expected Attention's query statistics are the
base's own (methods/expected_attention.py), not recomputed from a 256-token buffer: a difference named in
docs/methods.md. With `compression_ratio` instead of `budget` the target is int(prompt x (1 - ratio)) (not in kvpress).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_bool, check_float, check_int
from kvbench.methods.selection import top_tokens
from kvbench.methods.wrappers import ScorerWrapper, select_in_layer
from kvbench.runtime.contract import Observation


@register_method("decoding")
@dataclass
class Decoding(ScorerWrapper):
    """The base's selection every compression_interval decode steps; the prompt kept whole."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("interval",)
    compresses_prompt: ClassVar[bool] = False  # tests/methods/test_matrix.py: no bound after prefill
    decode: str = "interval"
    base: str = "knorm"
    head_adaptive: bool = False  # type: ignore[assignment]
    alpha_safeguard: float = 0.20
    compression_interval: int = 512

    def __post_init__(self) -> None:
        if self.interval is not None:
            raise UserError(f"method.interval={self.interval} is not decoding's: its interval is "
                            f"method.compression_interval (kvpress's name)")
        super().__post_init__()
        check_bool(self.name, "head_adaptive", self.head_adaptive)
        check_float(self.name, "alpha_safeguard", self.alpha_safeguard, 0.0, 1.0)
        check_int(self.name, "compression_interval", self.compression_interval, 1)

    def observes_in_decode(self) -> bool:
        return True  # the base scores from the latest generated tokens

    def min_tokens_per_head(self, budget: int) -> int:
        return int(budget * self.alpha_safeguard) if self.head_adaptive else 0  # kvpress AdaKVPress

    def decode_interval(self) -> int | None:
        """kvpress's compression_interval, through the one periodic policy (EvictionMethod.evict_every)."""
        return self.compression_interval

    def budget_holds(self, slot: int, layer: int) -> bool:
        """Whether (slot, layer) was compressed while decoding already (before that it holds the whole prompt)."""
        return bool(self._state.get((slot, layer), {}).get("decode_compressed", False))

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        return  # kvpress DecodingPress: prefill untouched

    def reselect(self, obs: Observation, budget: int) -> None:
        """kvpress DecodingPress's compression: by the base's scores alone (its own window aside), no newest floor."""
        scores = self.score(obs)  # [H, T]
        recent = min(self.recent_window(budget), budget)  # the base's own window (SnapKV's), no newest floor
        if self.head_adaptive:
            keep = select_in_layer(obs, scores, budget, recent, self.min_tokens_per_head(budget))
        else:
            keep = top_tokens(scores, budget, obs.lengths, recent=recent)
        self.keep(obs, keep)
        self.state(obs.slot, obs.layer)["decode_compressed"] = True
