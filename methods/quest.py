"""`quest`: Quest (Tang et al., ICML 2024; official code mit-han-lab/Quest, evaluation/quest_attention.py).

Query-aware retrieval, not eviction: every page stays resident; each decode step reads only the pages that may
matter to its query. A page is a block of the paged cache (the official chunk_size 16 = runtime.block_size 16).
Per page and kv-head the cache keeps the element-wise min and max of its keys; a decode step bounds q.k over a
page's keys by sum_d max(q_d * min_d, q_d * max_d) per query head and reads the top
max(3, budget // block_size) pages of each query head. Layers 0 and 1 and prefill (and any multi-token step, such as
speculative verification) read every page, as in the official code.

`budget` here is the tokens READ per decode step per query head (Quest's token_budget), not tokens kept: nothing
is evicted. With `evict=<method>`, an eviction method runs underneath with its own budget (`evict_budget`, tokens
KEPT per kv-head) and options (`evict_options`): "evict at prefill, retrieve at decode" (RocketKV's shape), e.g.
`method=quest budget=512 method.evict=snapkv method.evict_budget=2048` (a threshold rule, dms, takes no
evict_budget: its threshold goes in evict_options). Over a storage codec (`quant=kivi`, int8,
fp8; not kvquant, whose keys are stored before RoPE) the pages are the codec's blocks, summarized as they decode.

Where this differs from the official evaluation code (and why):
  - GQA: the official code repeats the keys over the group, so each query head selects and attends over its own
    pages. Here the selection is the same per query head; by default (`gqa=union`) a kv-head's kernel reads the
    union of its query heads' pages once and every head of the group attends over that union (a superset of its
    own pages). `gqa=per_head` is the official rule exactly: one table per query head, each head attending over
    its own pages only (the fused CPU step, the op-by-op kernels and codec pools run both). Equal for G = 1. The
    bytes read count each kv-head's distinct pages once under both rules (the union is the pages read).
  - The page count is min(max(3, budget // block_size), pages held). The official code first clamps the budget to
    the sequence length (`min(kv_seq_len, token_budget)`), which drops one page whenever the budget covers a
    context that is not a whole number of pages: here a budget that covers every page reads every page (equal to
    full attention).
  - The page min / max are kept in fp16, rounded outward (the official evaluation code holds them in the model's
    dtype, fp16 in its runs): with an fp32 model the bound is a hair looser than from fp32 summaries, never below
    the true page maximum, at half their bytes.
The mechanics (summaries kept by the pool, the bound, the top-k and the compacted tables the kernels are given) are
the runtime's (kvbench.runtime.cache.page_retrieval); this module decides which layers retrieve and how many pages.
Only the retrieving layers' blocks keep a page summary, and only theirs count it in peak_kv_bytes: the dense layers'
and sliding layers' blocks, which never read one, cost their K/V alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from kvbench.errors import UserError
from kvbench.methods.base import METHODS, Method, build_method, register_method
from kvbench.runtime.contract import PageRetrieval

MIN_PAGES = 3  # the official code reads at least 3 pages
GQA_MODES = ("union", "per_head")
# optional hooks an eviction method underneath may have (looked up with getattr by the engine)
def quest_pages(budget: int, block_size: int) -> int:
    """Pages each query head reads per step: max(3, budget // block_size) (official quest_attention.py)."""
    return max(MIN_PAGES, budget // block_size)


@register_method("quest")
@dataclass
class Quest(Method):
    """Quest's page retrieval in decode steps (see the module docstring), optionally over an eviction method."""

    retrieves: ClassVar[bool] = True
    dense_layers: int = 2  # the first layers read every page (official: layer_id < 2)
    gqa: str = "union"  # union: a kv-head's query heads attend over the union of their pages | per_head (official)
    evict: Optional[str] = None  # an eviction method underneath (its name), or None
    evict_budget: Optional[int] = None  # tokens that method KEEPS per kv-head (budget is tokens READ)
    evict_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compression_ratio is not None:
            raise UserError("method 'quest' takes budget=N (tokens read per decode step per query head), not "
                            "compression_ratio; an eviction underneath takes method.evict_budget")
        if self.budget is None:
            raise UserError("method 'quest' needs a budget: set budget=N (tokens read per decode step per query "
                            "head; nothing is evicted)")
        if not isinstance(self.dense_layers, int) or isinstance(self.dense_layers, bool) or self.dense_layers < 0:
            raise UserError(f"invalid quest.dense_layers={self.dense_layers!r}: expected an integer >= 0")
        if self.gqa not in GQA_MODES:
            raise UserError(f"invalid quest.gqa={self.gqa!r}: choose one of {', '.join(GQA_MODES)}")
        self.inner: Method | None = None
        self._declare()
        if self.evict is None:
            if self.evict_budget is not None or self.evict_options:
                raise UserError("quest.evict_budget / evict_options set without quest.evict: name the eviction "
                                "method underneath (method.evict=snapkv)")
            return
        if self.evict not in METHODS.names() or not METHODS[self.evict].evicts:
            choices = ", ".join(n for n in METHODS.names() if METHODS[n].evicts)
            raise UserError(f"invalid quest.evict={self.evict!r}: choose an eviction method: {choices}")
        if not METHODS[self.evict].needs_budget:  # a threshold rule (dms): no count kept
            if self.evict_budget is not None:
                raise UserError(f"invalid quest.evict_budget={self.evict_budget!r}: quest.evict={self.evict} keeps "
                                "what scores above its threshold (method.evict_options.threshold), not a count: "
                                "leave method.evict_budget unset")
        elif self.evict_budget is None:
            raise UserError(f"quest.evict={self.evict} needs method.evict_budget=N (tokens kept per kv-head; "
                            "budget is the tokens read per step)")
        if not isinstance(self.evict_options, dict):
            raise UserError(f"invalid quest.evict_options={self.evict_options!r}: expected a mapping")
        self.inner = build_method(self.evict, self.evict_budget, options_key="method.evict_options",
                                  budget_key="method.evict_budget", **dict(self.evict_options))
        if self.inner.needs_key_scores:
            raise UserError(f"quest.evict={self.evict}: {self.evict} reads every step's attention mass per key, "
                            "which a retrieving layer does not compute; choose a method that scores from its own "
                            "window (snapkv, pyramidkv, adakv, knorm, streaming_llm, ...)")
        if self.inner.store_pre_rope or self.inner.rope_mode != "original":
            raise UserError(f"quest.evict={self.evict}: Quest bounds keys cached after RoPE at their positions; "
                            f"{self.evict} caches them otherwise")
        self._declare()

    def _declare(self) -> None:
        """What the engine reads of the hook protocol: the eviction underneath's declarations (none without one)."""
        inner = self.inner
        self.needs_key_scores = bool(inner is not None and inner.needs_key_scores)
        self.acts_after_attention = bool(inner is not None and inner.acts_after_attention)
        self.acts_before_attention = bool(inner is not None and inner.acts_before_attention)
        self.decode_reads_attention = bool(inner is None or inner.decode_reads_attention)

    # the hooks of the method underneath (NoCompression's no-ops without one)
    def bind_engine(self, engine: Any) -> None:
        if self.inner is not None:
            self.inner.bind_engine(engine)

    def after_prefill_chunk(self, slot: int, token_ids: list[int], start_pos: int, last_chunk: bool) -> None:
        if self.inner is not None:
            self.inner.after_prefill_chunk(slot, token_ids, start_pos, last_chunk)

    def on_rollback(self, slot: int) -> None:
        if self.inner is not None:
            self.inner.on_rollback(slot)

    # --- hooks ------------------------------------------------------------------------------------------------
    def check_model(self, model_config) -> None:
        """Besides Method's checks: the pages are read by the plain attention kernels, so a full layer with
        soft-capping or attention sinks (Gemma 2, GPT-OSS) is refused in one line."""
        super().check_model(model_config)
        attention = getattr(model_config, "attention", None)
        for layer in range(model_config.num_layers) if callable(attention) else ():
            la = attention(layer)
            if la.window is None and not la.plain:
                raise UserError(f"method=quest reads pages through the plain attention kernels; layer {layer} of this "
                                f"model is {la.describe()} with soft-capping or sinks, which they do not apply")

    def attach(self, cache, model_config) -> None:
        super().attach(cache, model_config)
        pages = quest_pages(self.budget, cache.block_size)
        # sliding-window layers are never compressed (cache.method_layers): they attend over their ring densely
        method_layers = set(getattr(cache, "method_layers", None) or range(model_config.num_layers))
        self.page_retrieval = PageRetrieval(tuple(0 if layer < self.dense_layers or layer not in method_layers
                                                  else pages for layer in range(model_config.num_layers)),
                                            per_head=self.gqa == "per_head")
        if self.inner is not None:
            self.inner.attach(cache, model_config)

    def after_attention(self, ctx) -> None:
        if self.inner is not None:
            self.inner.after_attention(ctx)

    def before_attention(self, ctx) -> None:
        if self.inner is not None:
            self.inner.before_attention(ctx)

    def on_sequence_end(self, slot: int) -> None:
        if self.inner is not None:
            self.inner.on_sequence_end(slot)

    def on_fork(self, parent: int, child: int) -> None:
        if self.inner is not None:
            self.inner.on_fork(parent, child)

    def keep_uncompressed(self, slot: int, num_tokens: int) -> None:
        if self.inner is not None:
            self.inner.keep_uncompressed(slot, num_tokens)

    def tensor_parallel_refusal(self) -> str | None:
        return None if self.inner is None else self.inner.tensor_parallel_refusal()
