"""`random`: uniform random token scores, the baseline of kvpress's leaderboard (kvpress `RandomPress`).

Each kv-head keeps the `budget` tokens with the highest U(0, 1) scores. As in kvpress, the scores of one
call are torch.rand([H, T]) from a fresh generator seeded with `seed` (drawn on the CPU, so the choice is the same on
every device): every layer and every sequence of the same length therefore draws the same scores, and a seed gives
the same kept sets run after run. `seed` null takes the run's top-level seed; with none at all the scores come from
torch's global generator (not reproducible, kvpress's seed=None). The prompt is compressed once (decode="none") and
nothing is protected (no sinks, no recent window).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from kvbench.errors import UserError
from kvbench.methods.base import register_method
from kvbench.methods.scorer import ScorerMethod
from kvbench.runtime.contract import Observation


@register_method("random")
@dataclass
class RandomEviction(ScorerMethod):
    """Uniform random scores from a generator seeded with `seed` at every call."""
    supports_latent: ClassVar[bool] = True  # attention mass, positions or chance: defined on MLA's latent rows

    DECODE_POLICIES: ClassVar[tuple[str, ...]] = ("none",)

    seed: Optional[int] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise UserError(f"invalid random.seed={self.seed!r}: expected an integer or null")

    def score(self, obs: Observation) -> torch.Tensor:
        lengths = obs.lengths  # [H]
        H, T = lengths.shape[0], int(lengths.max())
        gen = torch.Generator().manual_seed(self.seed) if self.seed is not None else None
        return torch.rand(H, T, generator=gen).to(lengths.device)  # [H, T]
