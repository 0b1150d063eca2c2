"""Which methods run on MLA's latent cache is each class's declaration, `supports_latent` (issue 71, item 2): no
list to edit for a user's method; the built-ins declare what the list held."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from kvbench.errors import UserError
from kvbench.methods import METHODS, ScorerMethod, build_method
from kvbench.methods.base import latent_methods, latent_refusal

MLA = SimpleNamespace(mla=object())  # what check_model reads of an MLA model's config

# the methods whose scores are defined on latent rows (attention mass, positions, chance): the former LATENT_METHODS
LATENT = ["adakv", "full", "h2o", "kvzip", "pyramidkv", "random", "snapkv", "streaming_llm", "tova"]


def test_the_builtins_declare_the_latent_methods():
    assert latent_methods() == LATENT
    assert [n for n in METHODS.names() if METHODS[n].supports_latent] == LATENT


@dataclass
class LatentNorm(ScorerMethod):  # never registered: a user's class, declared
    supports_latent = True

    def score(self, obs):
        return obs.keys.norm(dim=-1)


def test_a_users_method_declares_it_without_editing_a_list():
    mine = LatentNorm(budget=16)
    mine.name = "latent_norm"
    assert latent_refusal(mine) is None
    mine.check_model(MLA)  # accepted
    with pytest.raises(UserError, match="method 'knorm' scores key or value geometry .* use one of adakv, full"):
        build_method("knorm", 16).check_model(MLA)


def test_a_wrapper_runs_on_mla_where_its_base_does():
    assert latent_refusal(build_method("adakv", 16, base="snapkv")) is None
    with pytest.raises(UserError, match="method 'adakv' over base 'knorm': method 'knorm' scores key or value"):
        build_method("adakv", 16, base="knorm").check_model(MLA)
