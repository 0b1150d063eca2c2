"""kvcompose / kvcompose_unstructured keep exactly kvpress KVComposePress's tokens: its steps written out here in plain
torch (loops as in kvpress's compute_scores / enhance_scores / compute_composite_scores / compute_important_per_layer
/ prepare_important_masks) over a transformers model's own attention probabilities of the context repeated after
itself."""
from __future__ import annotations

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.kvcompose import kvcompose_keep
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.byte_model_fixtures import VOCAB, hf, model  # noqa: F401  (fixtures)
from tests.fixtures.press_fixtures import assert_question_appended_whole
from tests.fixtures.task_fixtures import one_thread as _one_thread

BS, CHUNK = 8, 32

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def repeat_attentions(hf, ctx):
    """Eager attention probabilities of ctx + ctx (kvpress's second forward: the context again over its own cache)
    -> per layer [Hq, n, n]: the repeated tokens' rows over the first copy's keys."""
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            att = hf(torch.tensor([ctx + ctx]), output_attentions=True).attentions  # L x [1, Hq, 2n, 2n]
    finally:
        hf.set_attn_implementation(before)
    n = len(ctx)
    return [a[0, :, n:, :n].float() for a in att]


def kvcompose_press_kept(hf, ctx, compression_ratio, structured, agg_head="mean", lower_bound=0, per_table=None,
                         v_norm=False):
    """KVComposePress (kvpress @8bb29b9) on ctx, its steps written out -> kept [L, H, n] bool. per_table: kvbench's
    budget instead of a ratio (L x per_table composite ranks kept, L x H x per_table unstructured)."""
    att = repeat_attentions(hf, ctx)
    L, H = len(att), hf.config.num_key_value_heads
    Hq, n = att[0].shape[0], len(ctx)
    G = Hq // H
    task = [[att[layer][h].amax(dim=0) for h in range(Hq)] for layer in range(L)]  # MaxAggregator over the queries
    scores = torch.zeros(L, H, n)
    for layer in range(L):
        for kv in range(H):
            scores[layer, kv] = torch.stack([task[layer][h] for h in range(kv * G, (kv + 1) * G)]).mean(0)
    if v_norm:  # add_v_norm: x ||v|| of the context's cached values (kvpress reads the cache while it still holds
        # the repeat too, [2n] norms against [n] scores, and fails; the context's n values are what it means)
        with torch.no_grad():
            cache = hf(torch.tensor([ctx]), use_cache=True).past_key_values
        for layer in range(L):
            for kv in range(H):
                scores[layer, kv] = scores[layer, kv] * cache.layers[layer].values[0, kv].float().norm(dim=1)
    for layer in range(L):
        scores[layer] += scores[layer].mean(dim=0, keepdim=True)  # add_mean_across_heads
    per_head = scores.sort(dim=-1, descending=True)[0]
    per_head[..., :lower_bound] += 1e9
    per_layer = torch.zeros(L, n)
    for layer in range(L):
        ranked = torch.stack([scores[layer, kv].sort(descending=True)[0] for kv in range(H)])
        per_layer[layer] = ranked.mean(0) if agg_head == "mean" else ranked.amax(0)
    per_layer[..., :lower_bound] += 1e9
    per_layer[0] = per_layer.max(dim=0).values
    n_kept = int(per_head.numel() * (1 - compression_ratio)) if per_table is None else L * H * per_table
    important_per_head = torch.bincount(per_head.reshape(-1).topk(n_kept).indices // n, minlength=L * H).view(L, H)
    n_kept = int(per_layer.numel() * (1 - compression_ratio)) if per_table is None else L * per_table
    important_per_layer = torch.bincount(per_layer.reshape(-1).topk(n_kept).indices // n, minlength=L)
    kept = torch.zeros(L, H, n, dtype=torch.bool)
    for layer in range(L):
        for kv in range(H):
            count = important_per_layer[layer] if structured else important_per_head[layer, kv]
            kept[layer, kv, torch.argsort(scores[layer, kv], descending=True)[:count]] = True
    return kept


def kvbench_kept(model, method, ctx):
    """The positions each (layer, kv-head) table holds once kvbench's engine has prefilled ctx -> [L, H, n] bool."""
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=2048)
    slot = engine.new_sequence()
    for a in range(0, len(ctx), CHUNK):
        engine.forward_chunk(slot, ctx[a: a + CHUNK], a, last_chunk=a + CHUNK >= len(ctx), logits_for="none")
    cache = engine.cache
    L, H = cache.num_layers, cache.num_kv_heads
    kept = torch.zeros(L, H, len(ctx), dtype=torch.bool)
    for layer in range(L):
        for h in range(H):
            kept[layer, h, cache.positions[slot, layer, h, : int(cache.lengths[slot, layer, h])].long()] = True
    assert cache.pool.in_use == int(((cache.lengths[slot] + BS - 1) // BS).sum())  # the repeat's blocks freed
    engine.end_sequence(slot)
    return kept


@pytest.fixture(scope="module")
def ctx():
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, VOCAB, (90,), generator=g).tolist()


@pytest.mark.parametrize("structured", [True, False])
@pytest.mark.parametrize("opts", [{"compression_ratio": 0.5}, {"budget": 30}, {"budget": 30, "agg_head": "max"},
                                  {"budget": 30, "keep_token_lower_bound": 40}, {"budget": 30, "add_v_norm": True}])
def test_kvcompose_keeps_kvcomposepress_tokens(model, hf, ctx, structured, opts):
    opts = dict(opts)
    budget = opts.pop("budget", None)
    method = build_method("kvcompose", budget, structured=structured, **opts)
    got = kvbench_kept(model, method, ctx)
    want = kvcompose_press_kept(hf, ctx, opts.get("compression_ratio"), structured, opts.get("agg_head", "mean"),
                                opts.get("keep_token_lower_bound", 0), per_table=budget,
                                v_norm=opts.get("add_v_norm", False))
    assert torch.equal(got, want), (got ^ want).nonzero()[:10].tolist()
    L, H, n = got.shape
    counts = got.sum(-1)  # [L, H]
    assert int(counts.sum()) == L * H * (budget or n // 2)  # (n even: kvpress's int(L x n x 0.5) too)
    if structured:  # every kv-head of a layer keeps the same count
        assert bool((counts == counts[:, :1]).all())


def test_structured_and_unstructured_differ(model, ctx):
    """The two registry rows keep different sets (the unstructured one lets a layer's heads keep different counts)."""
    a = kvbench_kept(model, build_method("kvcompose", 30), ctx)
    b = kvbench_kept(model, build_method("kvcompose", 30, structured=False), ctx)
    assert not torch.equal(a, b)
    assert (b.sum(-1) != b.sum(-1)[:, :1]).any()


def test_selection_of_equal_heads_keeps_the_best_ranks():
    """kvcompose_keep on scores where every head of a layer ranks alike: layer 1's scores are all above layer 0's
    but layer 0's composite is lifted to the max over layers, so the layers split the budget evenly."""
    s = torch.stack([torch.arange(10.0).expand(2, 10), torch.arange(10.0).expand(2, 10) + 100])  # [2, 2, 10]
    kept = kvcompose_keep(s, torch.full((2, 2), 10), 8, structured=True)
    assert kept.sum(-1).tolist() == [[4, 4], [4, 4]]
    assert kept[0, 0].nonzero().flatten().tolist() == [6, 7, 8, 9]
    kept = kvcompose_keep(s, torch.full((2, 2), 10), 8, structured=False)
    assert kept.sum(-1).tolist() == [[0, 0], [4, 4]]


@pytest.mark.parametrize("opts, match", [({"agg_task": "mean"}, "agg_task"), ({"agg_group": "sum"}, "agg_group"),
                                         ({"structured": "yes"}, "structured"),
                                         ({"keep_token_lower_bound": -1}, "keep_token_lower_bound")])
def test_bad_options_name_the_value(opts, match):
    with pytest.raises(UserError, match=match):
        build_method("kvcompose", 10, **opts)


@pytest.mark.parametrize("name, structured", [("kvcompose", True), ("kvcompose_unstructured", False)])
def test_method_yamls_compose_to_kvpresss_defaults(name, structured):
    from kvbench.run.config import validate
    from kvbench.methods import METHODS
    from tests.harness_fakes import compose

    s = validate(compose([f"method={name}", "budget=256"]))
    assert s.method_name == "kvcompose"
    assert build_method(s.method_name, s.budget, **s.method_options) == METHODS["kvcompose"](budget=256,
                                                                                          structured=structured)


@pytest.mark.parametrize("structured", [True, False])
def test_kvcompose_keeps_an_uncompressed_question(model, ctx, structured):
    """keep_uncompressed (the query-agnostic protocol's question): the chunk is not repeated nor evicted, and every
    table holds it on top of what the context kept."""
    budget, question = 20, ctx[:12]
    method = build_method("kvcompose", budget, structured=structured)
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=1024)
    slot = engine.new_sequence()
    engine.forward_chunk(slot, ctx, 0, last_chunk=True, logits_for="none")
    before = engine.cache.lengths[slot].clone()
    assert int(before.sum()) == 2 * 2 * budget
    fed = []
    inner = method._reconstruct
    method._reconstruct = lambda *a: (fed.append(a), inner(*a))
    method.keep_uncompressed(slot, len(question))
    engine.forward_chunk(slot, question, len(ctx), last_chunk=True, logits_for="none")
    assert fed == []  # not repeated
    assert_question_appended_whole(engine, slot, len(ctx), len(question), before)
    engine.end_sequence(slot)
    assert not method._held and not method._state
