"""Composition by object and the one periodic decode policy (issue 71, item 3): docs/adding.md's wrapper of a
user's own, run from the doc's own code block; a wrapper given its base as an instance is the wrapper built by
name; the base's declarations and state come from one place; decode=interval re-selects every N decode steps."""
from __future__ import annotations

import os
import re
import sys
import types

import pytest

from kvbench.errors import UserError
from kvbench.methods import METHODS, build_method
from tests.methods.test_contract import BUDGET, NEW, _engine, _prefill, _prompts, _register_user_method
from tests.tiny_models import DISTINCT_SCORES, ByteTokenizer, tiny_model

ADDING = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "docs", "adding.md")


def doc_block(name: str) -> str:
    """The python code block of docs/adding.md that registers `name`."""
    blocks = re.findall(r"```python\n(.*?)```", open(ADDING).read(), flags=re.S)
    (block,) = [b for b in blocks if f'@register_method("{name}")' in b]
    return block


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, tokenizer=ByteTokenizer(), **DISTINCT_SCORES)


@pytest.fixture
def user_methods():
    """docs/adding.md's two methods, registered for this test only: my_knorm (a scorer) and my_sinks (a wrapper
    of one's own, executed from the doc's code block)."""
    my_knorm = _register_user_method()
    module = types.ModuleType("docs_adding_my_sinks")  # the doc's file, as a module (dataclasses look it up)
    sys.modules[module.__name__] = module
    exec(compile(doc_block("my_sinks"), ADDING, "exec"), module.__dict__)
    yield my_knorm, module.MySinks
    for name in ("my_knorm", "my_sinks"):
        METHODS._items.pop(name, None)
    for name in ("tests.methods.user_method", module.__name__):
        sys.modules.pop(name, None)


def test_the_docs_wrapper_keeps_its_sinks_and_the_bases_best(model, user_methods):
    MyKnorm, MySinks = user_methods
    ids = _prompts()[0]
    by_name = _prefill(model, build_method("my_sinks", BUDGET, base="my_knorm"), ids)
    by_object = _prefill(model, MySinks(budget=BUDGET, base=MyKnorm(budget=BUDGET)), ids)
    assert by_name == by_object
    assert all(set(range(4)) <= set(head) and len(head) == BUDGET for layer in by_name for head in layer)
    assert by_name != _prefill(model, build_method("knorm", BUDGET), ids)  # knorm alone drops some sinks
    # without sinks it is its base: the wrapper's default selection is the base's own (per kv-head)
    assert _prefill(model, build_method("my_sinks", BUDGET, base="my_knorm", sinks=0), ids) == \
        _prefill(model, build_method("knorm", BUDGET), ids)


def test_the_docs_wrapper_runs_periodically(model, user_methods):
    engine = _engine(model, build_method("my_sinks", BUDGET, base="my_knorm", decode="interval", interval=4))
    gens = engine.generate(_prompts(), max_new_tokens=NEW)
    assert all(len(g.token_ids) == NEW for g in gens)
    assert not engine.method._state  # the wrapper's state, the base's too, gone with the sequences


def test_a_base_instance_is_the_base_by_name(model):
    ids = _prompts()[1]
    from kvbench.methods.adakv import AdaKV

    snap = METHODS["snapkv"](budget=BUDGET, window=8)
    wrapper = AdaKV(budget=BUDGET, base=snap)
    assert wrapper.inner is snap and snap._state is wrapper._state  # one state, the wrapper's
    assert wrapper.query_window == 8 and wrapper.recent_window(BUDGET) == snap.recent_window(BUDGET)
    assert wrapper.describe()["base"] == "snapkv"
    assert _prefill(model, wrapper, ids) == _prefill(model, build_method("adakv", BUDGET, base="snapkv",
                                                                         base_options={"window": 8}), ids)


def test_a_base_instance_must_be_a_plain_scorer_without_base_options():
    from kvbench.methods.adakv import AdaKV

    with pytest.raises(UserError, match="invalid adakv.base=ChunkKV: a plain scorer"):
        AdaKV(budget=BUDGET, base=build_method("chunkkv", BUDGET))
    with pytest.raises(UserError, match="holds its own options"):
        AdaKV(budget=BUDGET, base=build_method("knorm", BUDGET), base_options={"decode": "evict"})


@pytest.mark.parametrize("name,opts,every_step", [
    ("knorm", {}, {"decode": "evict"}),
    ("snapkv", {"window": 8}, {"decode": "rescore"}),
    ("adakv", {"base": "knorm"}, {"decode": "evict"}),
    ("criticalkv", {"base": "knorm"}, {"decode": "evict"}),
])
def test_an_interval_of_one_is_the_every_step_policy(model, name, opts, every_step):
    """decode=interval interval=1 re-selects after every decode step: the method's every-step policy. (A wrapper's
    window-based base observes the decode steps under an interval, not under decode=evict: compared over knorm.)"""
    gens = {}
    for key, decode in (("interval", {"decode": "interval", "interval": 1}), ("every", every_step)):
        engine = _engine(model, build_method(name, 24, **opts, **decode))
        gens[key] = [g.token_ids for g in engine.generate(_prompts(), max_new_tokens=NEW)]
    assert gens["interval"] == gens["every"]


@pytest.mark.parametrize("name,opts", [("knorm", {}), ("snapkv", {"window": 4}), ("adakv", {"base": "tova"})])
def test_an_interval_reselects_every_n_decode_steps(model, name, opts):
    """A table compressed to the budget at prefill grows by one token a step and is back at the budget at every
    interval-th decode step: after step k it holds budget + k mod interval tokens (a head-adaptive layer: its
    tables together, kv_heads x that)."""
    interval, budget = 3, 24
    method = build_method(name, budget, **opts, decode="interval", interval=interval)
    assert method.decode_overshoot() == interval - 1
    engine = _engine(model, method)
    held = []
    inner_after = method.after_attention

    def after_attention(ctx):
        inner_after(ctx)
        if ctx.phase == "decode" and ctx.layer == 0:
            held.append(int(ctx.cache.lengths[0, 0].sum()))

    method.after_attention = after_attention
    engine.generate([_prompts()[0]], max_new_tokens=10)
    H = engine.cache.lengths.shape[-1]
    assert held == [H * (budget + k % interval) for k in range(1, len(held) + 1)], held
    assert len(held) == 9


def test_interval_is_read_only_with_decode_interval():
    with pytest.raises(UserError, match="method 'knorm' decode=interval needs method.interval"):
        build_method("knorm", 24, decode="interval")
    with pytest.raises(UserError, match=r"method.interval=8 is read only with method.decode=interval"):
        build_method("knorm", 24, interval=8)
    with pytest.raises(UserError, match=r"invalid snapkv.interval=0: expected an integer >= 1"):
        build_method("snapkv", 24, decode="interval", interval=0)
    with pytest.raises(UserError, match="its interval is method.compression_interval"):
        build_method("decoding", 24, interval=8)
    with pytest.raises(UserError, match="invalid chunkkv.decode='interval'"):  # its own selection: prefill only
        build_method("chunkkv", 24, decode="interval", interval=8)


@pytest.mark.parametrize("restarts", [True, False])
def test_a_due_step_within_the_budget_restarts_the_count_or_counts_on(restarts):
    """The periodic policy's count at a due step that finds the tables within the budget: DecodingPress starts it
    again; CAMPress (merge, decode=cam) counts on, so every later step is due and the merge folds in every step."""
    from kvbench.methods.eviction import DECODE_STEPS, EvictionMethod

    class Periodic:
        interval_restarts_within_budget = restarts

        def __init__(self):
            self.st, self.over, self.merged_at = {}, False, []

        def state(self, slot, layer):
            return self.st

        def over_budget(self, obs, budget):
            return self.over

        def reselect(self, obs, budget):
            self.merged_at.append(self.st[DECODE_STEPS])

    m = Periodic()
    for step in range(1, 7):  # interval 4: step 4 finds the table within the budget; it is over from step 5 on
        m.over = step >= 5
        EvictionMethod.evict_every(m, types.SimpleNamespace(slot=0, layer=0), 8, 4)
    # restarting: steps 5..8 count 1..4, nothing due by step 6; counting on: step 5 is due, the merge sees 5 steps
    assert m.merged_at == ([] if restarts else [5])
    assert m.st[DECODE_STEPS] == (2 if restarts else 1)
    assert METHODS["merge"].interval_restarts_within_budget is False
    assert METHODS["decoding"].interval_restarts_within_budget is True
