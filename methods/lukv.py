"""`lukv`: LU-KV (arXiv 2602.08585, "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic
KV Cache Eviction"; code baidu-baige/LU-KV; kvpress `LUKVPress`): per-(layer, kv-head) budgets from a precomputed
curve around any scorer (default Expected Attention with epsilon 0.02, the registry's `lukv`).

The curve is an array [99, layers, kv_heads] of prune ratios, one slice per target ratio 0.01 .. 0.99. At the
prompt's compression, with ratio r (compression_ratio, or 1 - budget / prompt with a budget: not in kvpress), the
slice round(100 r) - 1 gives each kv-head of the layer its prune ratio p; its ideal count (1 - p) x T is floored,
the layer's total round(sum of the ideal counts) is reached by giving one more token to the heads of largest
fractional part, and each head keeps at least 1 (kvpress's arithmetic). Each head then keeps its top tokens by the
base's scores, the first `sink` and the last `window` tokens first. kvpress masks the rest (fake keys); here the
tables shrink, each to its own size, so no per-table budget holds (table_budget None): the curve sets the sizes.

Curves (`curve_path`): a .npy file or an http(s) URL to one (downloaded once into the kvbench cache); null: kvpress's
table, which has one curve, Llama-3.1-8B-Instruct with expected_attention (epsilon 0.02, sink 4, window 1), from the
LU-KV repository. The curve is model- and scorer-specific: LU-KV's evaluation/curve_data/generate_curve.sh makes one.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from kvbench import atomic_write
from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.checks import check_int
from kvbench.methods.wrappers import ScorerWrapper
from kvbench.runtime.contract import Observation
from kvbench.runtime.model.loading import cache_root

LLAMA_3_1_8B_EA_CURVE_URL = ("https://raw.githubusercontent.com/baidu-baige/LU-KV/main/"
                             "evaluation/curve_data/llama-3.1-8b/ea_0.02_sink4_win1_llama_avg_ratio.npy")
CURVES = {("meta-llama/Llama-3.1-8B-Instruct", "expected_attention"): LLAMA_3_1_8B_EA_CURVE_URL}  # kvpress's table


def load_curve(path: str) -> torch.Tensor:
    """A budget curve [99, L, H] (float32) from a .npy file or an http(s) URL (cached under the kvbench cache)."""
    import numpy as np

    if path.startswith(("http://", "https://")):
        local = cache_root() / "lukv" / (hashlib.sha256(path.encode()).hexdigest()[:16] + ".npy")
        if not local.is_file():
            try:
                import urllib.request

                local.parent.mkdir(parents=True, exist_ok=True)
                with urllib.request.urlopen(path, timeout=60) as response:
                    data = response.read()
                with atomic_write.replaced(local) as tmp:
                    Path(tmp).write_bytes(data)
            except OSError as exc:
                raise UserError(f"cannot download the LU-KV curve {path} ({type(exc).__name__}); give a local .npy "
                                "with method.curve_path") from None
        path = str(local)
    if not Path(path).expanduser().is_file():
        raise UserError(f"invalid lukv.curve_path={path!r}: no such file (a .npy of shape [99, layers, kv_heads])")
    try:
        curve = np.load(Path(path).expanduser(), allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise UserError(f"invalid lukv.curve_path={path!r}: not a .npy array ({str(exc).splitlines()[0]})") from None
    return torch.as_tensor(curve, dtype=torch.float32)


def keep_counts(prune: torch.Tensor, T: int) -> torch.Tensor:
    """kvpress LUKVPress's tokens kept per kv-head of a layer: prune [H] ratios, T tokens -> [H] counts."""
    H = prune.shape[0]
    ideal = (1.0 - prune).clamp(min=0.0, max=1.0) * T
    total = int(torch.round(ideal.sum()).item())
    total = max(H, min(H * T, total))
    counts = torch.floor(ideal).long()
    remainder = total - int(counts.sum().item())
    if remainder > 0:
        counts[torch.topk(ideal - counts, k=min(remainder, H)).indices] += 1
    return counts.clamp_(min=1, max=T)


@register_method("lukv")
@dataclass
class LUKV(ScorerWrapper):
    """The base's scores; each kv-head's count from LU-KV's budget curve at the prompt's ratio."""

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)
    reselects_by_score: ClassVar[bool] = False  # its own selection (no decode="interval")
    budget_bounds_tables: ClassVar[bool] = False  # the curve, not the budget, sizes the tables (tests read this)
    decode: str = "none"
    base: str = "expected_attention"
    base_options: dict = field(default_factory=lambda: {"epsilon": 0.02})
    sink: int = 4
    window: int = 1
    curve_path: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.name, "sink", self.sink, 0)
        check_int(self.name, "window", self.window, 0)
        if self.curve_path is not None and not isinstance(self.curve_path, str):
            raise UserError(f"invalid lukv.curve_path={self.curve_path!r}: expected a .npy path or URL")
        self.curve: Optional[torch.Tensor] = None  # [99, L, H]

    @property
    def budget_scope(self) -> str:  # type: ignore[override]
        return "table"

    def table_budget(self, layer: int, head: int) -> int | None:
        return None  # the curve sizes each table

    def tensor_parallel_refusal(self) -> str | None:
        return "the curve sizes every kv-head of a layer together"

    def bind_engine(self, engine: Any) -> None:
        """Load the curve (curve_path, or kvpress's for the engine's model and this base) and check its shape."""
        super().bind_engine(engine)
        model = engine.model
        path = self.curve_path
        if path is None:
            key = (getattr(model, "name_or_path", None), self.base_name())
            path = CURVES.get(key)
            if path is None:
                raise UserError(f"lukv: no LU-KV budget curve for model {key[0]!r} with base {key[1]!r} (kvpress "
                                f"has one: {', '.join(f'{m} with {b}' for m, b in CURVES)}); give method.curve_path")
        curve = load_curve(path)
        want = (99, model.config.num_layers, model.config.num_kv_heads)
        if tuple(curve.shape) != want:
            raise UserError(f"LU-KV curve {path!r} has shape {tuple(curve.shape)}; this model needs {want} "
                            "(99 ratios x layers x kv_heads)")
        self.curve = curve

    def evict_prefill(self, obs: Observation, budget: int) -> None:
        if self.curve is None:
            raise RuntimeError("lukv: the engine did not call bind_engine")
        lengths = obs.table_lengths()
        T = max(lengths)
        ratio = self.compression_ratio if self.compression_ratio is not None else max(0.0, 1.0 - budget / T)
        if ratio <= 0:
            return
        index = max(0, min(98, int(round(ratio * 100)) - 1))  # kvpress: Python's round
        counts = keep_counts(self.curve[index, obs.layer], T)  # [H]
        if bool((counts >= torch.tensor(lengths)).all()):
            return
        scores = self.score(obs).float().clone()  # [H, T]
        if self.sink > 0:
            scores[:, : min(self.sink, T)] = float("inf")  # kvpress: the largest score + 1
        if self.window > 0:
            scores[:, max(0, T - self.window):] = float("inf")
        H = len(lengths)
        keep = torch.full((H, int(counts.max())), -1, dtype=torch.long, device=scores.device)
        for h in range(H):
            order = torch.argsort(scores[h, : lengths[h]], descending=True, stable=True)
            kept = order[: int(counts[h])].sort().values
            keep[h, : kept.numel()] = kept
        self.keep(obs, keep)
