"""A researcher's own method, exactly as docs/adding.md shows it: one file, one score(). Imported by the contract
tests (tests/methods/test_contract.py), which register it for their own duration only."""
from dataclasses import dataclass

from kvbench.methods import ScorerMethod, register_method


@register_method("my_knorm")
@dataclass
class MyKnorm(ScorerMethod):
    def score(self, obs):
        return -obs.keys.norm(dim=-1)
