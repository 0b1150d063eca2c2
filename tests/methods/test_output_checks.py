"""Issue 68, item 3: a method's output is checked where the runtime receives it (methods/output_checks.py). A scorer
returning [H, T-1], [H, T+1], [T], a list, NaN (all or some) or a tensor on the meta device ran with status ok or failed
with a line that did not name the method; now MethodOutputError names the method, the layer and what was wrong."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kvbench.methods import EvictionMethod, Method, ScorerMethod
from kvbench.methods.output_checks import MethodOutputError
from kvbench.runtime.serving.engine import Engine
from tests.tiny_models import DISTINCT_SCORES, ByteTokenizer, tiny_model

BS, CHUNK, BUDGET = 8, 32, 40


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)


def _some_nan(s):
    s = s.clone()
    s[0, 3] = float("nan")
    return s


# what score() returns, from the good scores s [H, T]
BAD_SCORES = {
    "H,T-1": (lambda s: s[:, :-1], "returned shape [2, 99]; expected [2, 100]"),
    "H,T+1": (lambda s: torch.cat([s, s[:, :1]], 1), "returned shape [2, 101]; expected [2, 100]"),
    "T": (lambda s: s[0], "returned shape [100]; expected [2, 100]"),
    "list": (lambda s: s.tolist(), "returned a list; expected a torch.Tensor"),
    "all NaN": (lambda s: torch.full_like(s, float("nan")), "returned 200 NaN of 200 scores"),
    "some NaN": (_some_nan, "returned 1 NaN of 200 scores"),
    "meta": (lambda s: s.to("meta"), "returned a tensor on meta; expected the cache's device cpu"),
    "bool": (lambda s: s > 0, "returned dtype torch.bool"),
}


def _scorer(make_bad):
    @dataclass
    class BadScorer(ScorerMethod):
        def score(self, obs):
            return make_bad(-obs.keys.norm(dim=-1))  # knorm's scores, spoilt

    BadScorer.name = "bad_scorer"
    return BadScorer(budget=BUDGET)


def _prefill(model, method, n=100):
    engine = Engine(model, method, block_size=BS, num_blocks=1024, prefill_chunk_size=CHUNK, prefix_caching=False)
    slot = engine.new_sequence()
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    for a in range(0, n, CHUNK):
        engine.forward_chunk(slot, ids[a: a + CHUNK], a, last_chunk=a + CHUNK >= n, logits_for="none")
    return engine


@pytest.mark.parametrize("case", list(BAD_SCORES))
def test_a_bad_score_is_refused_naming_the_method_and_the_layer(model, case):
    make_bad, needle = BAD_SCORES[case]
    with pytest.raises(MethodOutputError) as info:
        _prefill(model, _scorer(make_bad))
    line = str(info.value)
    assert "\n" not in line and line.startswith("method 'bad_scorer' (layer 0, prefill): score() "), line
    assert needle in line, line


def test_good_scores_and_infinities_pass(model):
    # +inf / -inf are scores (SnapKV's window is +inf): ranked, not refused
    engine = _prefill(model, _scorer(lambda s: torch.where(s > s.mean(), torch.full_like(s, float("inf")), s)))
    assert int(engine.cache.lengths[0].max()) == BUDGET


def test_a_wrapper_over_a_bad_scorer_names_it(model):
    from kvbench.methods import build_method

    adakv = build_method("adakv", BUDGET)
    adakv.inner = _scorer(BAD_SCORES["H,T-1"][0])  # the base scorer, spoilt
    with pytest.raises(MethodOutputError, match=r"method 'bad_scorer' \(layer 0, prefill\): score\(\) returned shape"):
        _prefill(model, adakv)


BAD_KEEPS = {
    "wide": (lambda keep, T: torch.arange(T + 1).expand(keep.shape[0], T + 1), "expected [2, n] with n <= 100"),
    "float": (lambda keep, T: keep.float(), "dtype torch.float32; expected torch.int64"),
    "out of range": (lambda keep, T: keep + T, "slots outside [-1, 100)"),
    "list": (lambda keep, T: keep.tolist(), "keep set is a list"),
}


@pytest.mark.parametrize("case", list(BAD_KEEPS))
def test_a_bad_keep_set_is_refused_naming_the_method(model, case):
    make_bad, needle = BAD_KEEPS[case]

    @dataclass
    class BadKeeper(EvictionMethod, Method):
        evicts = True

        def evict_prefill(self, obs, budget):
            T = obs.keys.shape[1]
            self.keep(obs, make_bad(torch.arange(budget).expand(obs.num_kv_heads, budget).contiguous(), T))

    BadKeeper.name = "bad_keeper"
    with pytest.raises(MethodOutputError) as info:
        _prefill(model, BadKeeper(budget=BUDGET))
    assert str(info.value).startswith("method 'bad_keeper' (layer 0, prefill): its keep set ")
    assert needle in str(info.value), str(info.value)
