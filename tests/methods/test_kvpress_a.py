"""random, knorm, tova, expected_attention, lagkv and pyramidkv keep exactly the tokens of their definitions (kvpress's
presses, written out here in plain torch from a transformers model's own keys, values, attention probabilities and
pre-RoPE queries), prefill in one chunk or several, and their budgets and YAMLs hold."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvbench.errors import UserError
from kvbench.methods import METHODS, build_method
from kvbench.methods.pyramidkv import pyramid_budgets
from kvbench.runtime.model.families import build_from_transformers
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.press_fixtures import PROMPT_TOKENS, hf, hf_out, ids, scoring_hf_model as _hf  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.methods.test_snapkv_official import official_keep

T, BUDGET = PROMPT_TOKENS, 120  # T: the prompt of the shared ids fixture
NAMES = ["random", "knorm", "tova", "expected_attention", "lagkv", "pyramidkv"]


one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


def kept_after_prefill(hf, ids, method, chunk: int, block_size: int = 16):
    """Run kvbench's engine on the prompt; the original positions each (layer, kv-head) table holds once the
    prompt is compressed -> {layer: [set per kv-head]}, and the engine (engine.blocks_after_prefill: blocks in use
    once every layer is compressed; the pool's count matches the tables' lengths after every layer)."""
    kept = {}
    inner = method.after_attention

    def after_attention(ctx):
        inner(ctx)
        if ctx.phase == "prefill" and ctx.last_chunk:
            lengths = ctx.cache.lengths[0, ctx.layer]
            kept[ctx.layer] = [set(ctx.cache.positions[0, ctx.layer, h, : int(lengths[h])].tolist())
                               for h in range(lengths.shape[0])]
            in_use = sum(int(((ctx.cache.lengths[s] + block_size - 1) // block_size).sum()) for s in ctx.cache.live)
            assert ctx.cache.pool.in_use == in_use  # evicted blocks went back to the pool
            engine.blocks_after_prefill = in_use

    method.after_attention = after_attention
    engine = Engine(build_from_transformers(hf), method, block_size=block_size, num_blocks=512,
                    prefill_chunk_size=chunk, attention_backend="torch")
    engine.generate([ids.tolist()], max_new_tokens=1)
    assert engine.cache.pool.in_use == 0
    return kept, engine


def top_sets(scores: torch.Tensor, k: int) -> list[set]:
    """scores [H, T] -> the k best indices of each row."""
    return [set(row.topk(k).indices.tolist()) for row in scores]


def layer_kv(out, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers cache's keys and values of one layer: [H, T, D] each (keys post-RoPE)."""
    c = out.past_key_values.layers[layer]
    return c.keys[0].float(), c.values[0].float()


# ------------------------------------------------------------------------------------------------ definitions
def knorm_reference(out, layer: int, budget: int) -> list[set]:
    k, _ = layer_kv(out, layer)
    return top_sets(-k.norm(dim=-1), budget)


def tova_reference(out, layer: int, budget: int, heads: str) -> list[set]:
    probs = out.attentions[layer][0].float()  # [Hq, T, T]
    last = probs[:, -1, :-1]  # the last query over every earlier key (its softmax includes itself)
    H = out.past_key_values.layers[layer].keys.shape[1]
    if heads == "shared":
        s = last.mean(0, keepdim=True).expand(H, -1)
    else:
        s = last.view(H, -1, last.shape[-1]).mean(1)
    s = F.pad(s, (0, 1), value=float(s.max()) + 1)  # the newest token is kept
    return top_sets(s, budget)


def expected_attention_reference(hf, out, layer: int, budget: int, n_future: int = 512, n_sink: int = 4,
                                 use_covariance: bool = True, use_vnorm: bool = True, eps: float = 0.0) -> list[set]:
    attn = hf.model.layers[layer].self_attn
    cfg = hf.config
    Hq, D = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        h = hf.model.layers[layer].input_layernorm(out.hidden_states[layer])  # [1, T, E]
        n = h.shape[1]
        q = attn.q_proj(h[:, n_sink:]).view(n - n_sink, Hq, D).transpose(0, 1).double()  # [Hq, N, D] pre-RoPE
        mu = q.mean(1)  # [Hq, D]
        centred = q - mu[:, None]
        cov = centred.transpose(1, 2) @ centred / q.shape[1]  # [Hq, D, D]
        cos, sin = hf.model.rotary_emb(h, torch.arange(n, n + n_future)[None])
        cos, sin = cos[0].double(), sin[0].double()  # [n_future, D]
        P = torch.zeros(D, D, dtype=torch.float64)
        P[D // 2:, : D // 2], P[: D // 2, D // 2:] = torch.eye(D // 2), -torch.eye(D // 2)
        R = torch.stack([torch.diag(c) + torch.diag(s) @ P for c, s in zip(cos, sin)]).mean(0)  # [D, D]
        mu, cov = mu @ R.T, R @ cov @ R.T
    k, v = layer_kv(out, layer)  # [H, T, D]
    H = k.shape[0]
    k, v = k[:, n_sink:].double(), v[:, n_sink:].double()
    kq = k.repeat_interleave(Hq // H, dim=0)  # [Hq, T', D] (repeat_kv)
    logits = (kq @ mu[:, :, None])[..., 0] / math.sqrt(D)
    if use_covariance:
        logits = logits + torch.einsum("hti,hij,htj->ht", kq, cov, kq) / D / 2
    s = logits.softmax(-1).view(H, Hq // H, -1).mean(1)  # [H, T']
    if use_vnorm:
        s = (s + eps) * v.norm(dim=-1)
    s = F.pad(s, (n_sink, 0), value=float(s.max()) + 1)
    return top_sets(s, budget)


def lagkv_reference(out, layer: int, budget: int, n_sink: int, lag: int) -> list[set]:
    k, v = layer_kv(out, layer)
    H, n, _ = k.shape
    end = n_sink + (n - n_sink) // lag * lag
    scores = torch.ones(H, n)  # sinks and the tail (last partition + remainder) score 1
    for start in range(n_sink, end - lag, lag):  # every partition that has a next one
        part = 0
        for x in (k, v):
            cur, ref = x[:, start: start + lag], x[:, start + lag: start + 2 * lag]  # [H, lag, D]
            lo, hi = ref.min(1, keepdim=True).values, ref.max(1, keepdim=True).values
            part = part + ((cur - lo) / (hi - lo)).std(-1).softmax(-1) / 2  # [H, lag]
        scores[:, start: start + lag] = part.argsort(-1).argsort(-1).float() / lag
    return top_sets(scores, budget)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("chunk", [T, 64])
def test_knorm_keeps_the_lowest_key_norms(hf, ids, hf_out, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("knorm", BUDGET), chunk)
    for layer in range(2):
        assert kept[layer] == knorm_reference(hf_out, layer, BUDGET), f"layer {layer}"


@pytest.mark.parametrize("heads", ["shared", "per_head"])
@pytest.mark.parametrize("chunk", [T, 64])
def test_tova_keeps_the_last_querys_top_tokens(hf, ids, hf_out, heads, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("tova", BUDGET, heads=heads), chunk)
    for layer in range(2):
        assert kept[layer] == tova_reference(hf_out, layer, BUDGET, heads), f"layer {layer}"
        if heads == "shared":
            assert kept[layer][0] == kept[layer][1]  # one token set for the whole layer
    if heads == "per_head":
        assert any(kept[layer][0] != kept[layer][1] for layer in range(2))


@pytest.mark.parametrize("opts", [{}, {"use_covariance": False, "use_vnorm": False, "n_future_positions": 64},
                                  {"n_sink": 0, "epsilon": 0.01}])
@pytest.mark.parametrize("chunk", [T, 64])
def test_expected_attention_keeps_the_definitions_tokens(hf, ids, hf_out, opts, chunk):
    kept, _ = kept_after_prefill(hf, ids, build_method("expected_attention", BUDGET, **opts), chunk)
    ref_opts = {"n_future": opts.get("n_future_positions", 512), "n_sink": opts.get("n_sink", 4),
                "use_covariance": opts.get("use_covariance", True), "use_vnorm": opts.get("use_vnorm", True),
                "eps": opts.get("epsilon", 0.0)}
    for layer in range(2):
        assert kept[layer] == expected_attention_reference(hf, hf_out, layer, BUDGET, **ref_opts), f"layer {layer}"
        assert set(range(ref_opts["n_sink"])) <= kept[layer][0]


def test_expected_attention_defaults_are_kvpress(hf):
    m = build_method("expected_attention", 64)
    assert (m.n_future_positions, m.n_sink, m.use_covariance, m.use_vnorm, m.epsilon, m.decode) == \
        (512, 4, True, True, 0.0, "none")


@pytest.mark.parametrize("chunk", [T, 64])
def test_lagkv_keeps_the_lag_relative_top_tokens(hf, ids, hf_out, chunk):
    n_sink, lag = 4, 16
    # 13 scored partitions, sinks (4) and tail (18): a budget of whole rank levels has no tie at the cut
    budget = n_sink + 18 + 13 * 7
    kept, _ = kept_after_prefill(hf, ids, build_method("lagkv", budget, lag_size=lag), chunk)
    for layer in range(2):
        want = lagkv_reference(hf_out, layer, budget, n_sink, lag)
        assert kept[layer] == want, f"layer {layer}"
        assert set(range(n_sink)) | set(range(T - 18, T)) <= kept[layer][0]


def test_lagkv_short_table_keeps_sinks_and_the_newest(hf, ids):
    """Below n_sink + 2 * lag_size (the defaults: 260 > 230 tokens) no partition has a reference: kvpress keeps the
    sinks and the newest tokens."""
    kept, _ = kept_after_prefill(hf, ids, build_method("lagkv", BUDGET), T)
    want = set(range(4)) | set(range(T - (BUDGET - 4), T))
    assert all(heads == [want, want] for heads in kept.values())


def test_random_is_deterministic_for_a_seed_and_uniform_topk(hf, ids):
    a, _ = kept_after_prefill(hf, ids, build_method("random", BUDGET, seed=7), T)
    b, _ = kept_after_prefill(hf, ids, build_method("random", BUDGET, seed=7), 64)
    c, _ = kept_after_prefill(hf, ids, build_method("random", BUDGET, seed=8), T)
    assert a == b and a != c
    want = top_sets(torch.rand(2, T, generator=torch.Generator().manual_seed(7)), BUDGET)
    assert a[0] == want and a[1] == want  # kvpress reseeds at every call: every layer draws the same scores
    assert build_method("random", BUDGET, seed=5).seed == 5  # the run's top-level seed reaches a null method seed


def test_pyramid_budgets_follow_kvpress_and_sum_to_layers_times_budget():
    def kvpress_layer_budget(layer, L, q_len, kept, window, beta):  # kvpress's get_layer_budget, ratio -> kept
        cap = window + kept
        lo = (cap - window) / beta
        hi = (cap - window) * 2 - lo
        if hi >= q_len - window:
            hi = q_len - window
            lo = (cap - window) * 2 - hi
        if not (q_len >= hi >= lo >= window):
            return round(kept)
        return round(hi - layer * (hi - lo) / (L - 1))

    for L, n, budget, window, beta in [(32, 4096, 2048, 64, 20), (32, 4096, 1500, 64, 20), (30, 8000, 3001, 64, 20),
                                       (4, 230, 100, 8, 2), (7, 1000, 333, 16, 5), (32, 4096, 1024, 64, 20)]:
        got = pyramid_budgets(budget, n, L, window, beta)
        assert sum(got) == L * budget
        assert got == sorted(got, reverse=True)
        want = [kvpress_layer_budget(layer, L, n, budget, window, beta) for layer in range(L)]
        assert all(abs(g - w) <= 1 for g, w in zip(got, want)), (got, want)
        assert sum(g != w for g, w in zip(got, want)) <= 2
    assert pyramid_budgets(1024, 4096, 32, 64, 20) == [1024] * 32  # 1024 / 20 < window: SnapKV (as kvpress)
    assert pyramid_budgets(2048, 4096, 32, 64, 20)[0] > 2048 > pyramid_budgets(2048, 4096, 32, 64, 20)[-1]
    assert pyramid_budgets(300, 200, 4, 8, 2) == [200] * 4  # the prompt fits: nothing is evicted


@pytest.mark.parametrize("L,budget,window,beta", [(4, 100, 8, 2), (30, 512, 16, 20), (7, 333, 16, 5), (2, 45, 8, 2)])
def test_pyramid_table_budget_bounds_every_prompt_length(L, budget, window, beta):
    """table_budget (the per-table bound the methods matrix checks) holds whatever the prompt's length."""
    from types import SimpleNamespace

    m = build_method("pyramidkv", budget, window=window, beta=beta)
    m.model_config = SimpleNamespace(num_layers=L)
    bounds = [m.table_budget(layer, 0) for layer in range(L)]
    assert bounds[0] > budget and bounds[-1] == budget
    most = [0] * L
    for n in range(1, 4 * budget, 3):
        got = pyramid_budgets(budget, n, L, window, beta)
        assert all(g <= b for g, b in zip(got, bounds)), n
        most = [max(a, g) for a, g in zip(most, got)]
    assert all(b - m <= 1 for b, m in zip(bounds, most))  # tight up to rounding


@pytest.mark.parametrize("chunk", [T, 64])
def test_pyramidkv_layers_keep_snapkvs_tokens_at_their_pyramid_budgets(ids, chunk):
    hf = _hf(4)
    with torch.no_grad():
        out = hf(ids[None], output_attentions=True)
    budget, window, beta = 100, 8, 2
    method = build_method("pyramidkv", budget, window=window, beta=beta)
    kept, engine = kept_after_prefill(hf, ids, method, chunk, block_size=8)
    budgets = pyramid_budgets(budget, T, 4, window, beta)
    assert sum(budgets) == 4 * budget and budgets[0] > budget > budgets[-1]
    for layer, probs in enumerate(out.attentions):
        assert [len(h) for h in kept[layer]] == [budgets[layer]] * 2
        assert kept[layer] == official_keep(probs[0].float(), 2, window, 5, budgets[layer]), f"layer {layer}"
    # every layer's blocks beyond its own budget went back to the pool
    assert engine.blocks_after_prefill == sum(2 * -(-b // 8) for b in budgets) < 4 * 2 * -(-T // 8)


@pytest.mark.parametrize("name", NAMES)
def test_methods_need_a_budget_and_keep_it_per_table(hf, ids, name):
    """Streaming prefill (evict after every chunk): every table within its budget, the pool's peak below full."""
    with pytest.raises(UserError, match="needs a budget"):
        build_method(name, None)
    method = build_method(name, 50, prefill_mode="streaming", **({"window": 8} if name == "pyramidkv" else {}))
    kept, engine = kept_after_prefill(hf, ids, method, 64, block_size=8)
    for layer, heads in kept.items():
        limit = method.layer_budget(layer, T) if name == "pyramidkv" else 50
        assert all(len(h) <= limit for h in heads)
    assert engine.blocks_after_prefill <= 2 * 2 * -(-50 // 8)
    stats = engine.memory_stats()
    assert stats["peak_kv_bytes"] < stats["full_kv_bytes"]


@pytest.mark.parametrize("name,opts,match", [
    ("random", {"seed": 1.5}, "random.seed"),
    ("tova", {"heads": "group"}, "tova.heads"),
    ("tova", {"decode": "window"}, "tova.decode"),
    ("knorm", {"decode": "window"}, "knorm.decode"),  # none | evict
    ("expected_attention", {"n_future_positions": 0}, "n_future_positions"),
    ("expected_attention", {"use_covariance": "yes"}, "use_covariance"),
    ("expected_attention", {"epsilon": -1.0}, "epsilon"),
    ("lagkv", {"lag_size": 0}, "lag_size"),
    ("lagkv", {"n_sink": -1}, "n_sink"),
    ("pyramidkv", {"beta": 0}, "beta"),
    ("pyramidkv", {"decode": "rescore"}, "pyramidkv.decode"),
])
def test_bad_options_name_the_value(name, opts, match):
    with pytest.raises(UserError, match=match):
        build_method(name, 64, **opts)


@pytest.mark.parametrize("name", NAMES)
def test_method_yaml_composes_to_the_dataclass_defaults(name):
    from kvbench.run.config import validate
    from tests.harness_fakes import compose

    s = validate(compose([f"method={name}", "budget=256"]))
    assert s.method_name == name
    assert build_method(s.method_name, s.budget, **s.method_options) == METHODS[name](budget=256)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_is_compressed_once_and_generated_tokens_are_appended(hf, ids, name):
    """decode=none (kvpress's presses): after the prompt's compression nothing leaves; every generated token stays."""
    budget, steps = 60, 12
    method = build_method(name, budget, **({"window": 8} if name == "pyramidkv" else {}))
    assert method.decode == "none"
    kept, engine = kept_after_prefill(hf, ids, method, 64, block_size=8)
    at_end = {}
    inner_end = method.on_sequence_end

    def on_sequence_end(slot):
        for layer in range(engine.cache.num_layers):
            lengths = engine.cache.lengths[slot, layer]
            at_end[layer] = [set(engine.cache.positions[slot, layer, h, : int(lengths[h])].tolist())
                             for h in range(lengths.shape[0])]
        inner_end(slot)

    method.on_sequence_end = on_sequence_end
    kept.clear()
    engine.generate([ids.tolist()], max_new_tokens=steps + 1)  # the last token is never fed back
    generated = set(range(T, T + steps))
    for layer, heads in kept.items():
        assert all(len(h) <= budget for h in heads)
        assert at_end[layer] == [h | generated for h in heads]
