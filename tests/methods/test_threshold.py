"""dms (threshold eviction over any scorer), kvzap (KVzip+ surrogates) and kvzip's KVzip+ normalisation on the tiny
model, against transcriptions of kvpress's DMSPress, KVzapPress, KVzipPress(kvzip_plus_normalization=True) and
kvzap/data.py; kvbench-train-kvzap's fits; the realized kept fraction per run and per sample; bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.methods.kvzap import KVzapSurrogate, hub_id, load_surrogate
from kvbench.methods.kvzip import FIRST_PROMPT
from kvbench.methods import kvzap_train
from kvbench.runtime.serving.engine import Engine
from tests.fixtures.byte_model_fixtures import VOCAB, hf, model  # noqa: F401  (fixtures)
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import ByteTokenizer

BS = 8
CHUNK = 32

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


class DecodingByteTokenizer(ByteTokenizer):
    def decode(self, ids):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="ignore")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (150, 121, 97)]


def surrogate_folder(tmp_path_factory, hf, kind: str) -> str:
    """A random surrogate for the tiny model in the hub's format (scores around 0, spread about 1)."""
    cfg = hf.config
    torch.manual_seed(0 if kind == "linear" else 1)
    net = KVzapSurrogate(cfg.hidden_size, cfg.num_key_value_heads, cfg.num_hidden_layers,
                         None if kind == "linear" else 16)
    folder = tmp_path_factory.mktemp(f"kvzap_{kind}")
    net.save(folder)
    return str(folder)


@pytest.fixture(scope="module")
def linear_path(tmp_path_factory, hf):
    return surrogate_folder(tmp_path_factory, hf, "linear")


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory, hf):
    return surrogate_folder(tmp_path_factory, hf, "mlp")


def hf_attention_inputs(hf, ids):
    """[L][N, E] the attention input (kwargs hidden_states of self_attn: after input_layernorm) of a full forward."""
    got, hooks = {}, []
    for li, layer in enumerate(hf.model.layers):
        def capture(module, args, kwargs, li=li):
            got[li] = kwargs["hidden_states"][0].detach().clone()
        hooks.append(layer.self_attn.register_forward_pre_hook(capture, with_kwargs=True))
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [got[li] for li in range(len(got))]


def kvpress_kvzap_scores(net, hidden):
    """KVzapPress.score: the layer's module on hidden [N, E] -> [H, N] (kvzap_module(h).transpose(1, 2))."""
    with torch.no_grad():
        return net(hidden)  # [N, H]


def kept_positions(engine, slot):
    lengths = engine.cache.lengths[slot]
    return [[sorted(engine.cache.positions[slot, li, h, : int(lengths[li, h])].tolist())
             for h in range(lengths.shape[1])] for li in range(lengths.shape[0])]


def positions_at_end(engine, method) -> dict:
    """Wrap method.on_sequence_end: the returned dict gets, under "pos", kept_positions of the sequence as it ends."""
    kept = {}
    orig_end = method.on_sequence_end

    def on_end(slot):
        kept["pos"] = kept_positions(engine, slot)
        orig_end(slot)

    method.on_sequence_end = on_end
    return kept


def prefill(model, method, ids, chunk=CHUNK):
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=chunk, num_blocks=4096)
    slot = engine.new_sequence()
    for a in range(0, len(ids), chunk):
        engine.forward_chunk(slot, ids[a: a + chunk], a, last_chunk=a + chunk >= len(ids), logits_for="none")
    return engine, slot


# ---------------------------------------------------------------------------- surrogates: format and scores
def test_surrogate_files_are_the_hubs_format(linear_path, mlp_path, hf):
    """kvpress KVzapModel.save_pretrained: config.json (input_dim, output_dim, hidden_dim, n_modules) and
    model.safetensors with layers.<i>.weight (linear) or layers.<i>.0.* / layers.<i>.2.* (MLP: Linear, GELU, Linear)."""
    from safetensors.torch import load_file

    L = hf.config.num_hidden_layers
    for path, keys in ((linear_path, {f"layers.{i}.{p}" for i in range(L) for p in ("weight", "bias")}),
                       (mlp_path, {f"layers.{i}.{j}.{p}" for i in range(L) for j in (0, 2) for p in ("weight", "bias")})):
        cfg = json.load(open(f"{path}/config.json"))
        assert cfg["model_type"] == "kvzap" and cfg["n_modules"] == L
        assert cfg["input_dim"] == hf.config.hidden_size and cfg["output_dim"] == hf.config.num_key_value_heads
        assert set(load_file(f"{path}/model.safetensors")) == keys
        net = load_surrogate(path)
        x = torch.randn(5, L, hf.config.hidden_size)
        y = net(x)
        assert y.shape == (5, L, hf.config.num_key_value_heads)
    assert hub_id("mlp", "Qwen/Qwen3-8B") == "nvidia/KVzap-mlp-Qwen3-8B"


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kvzap_prefill_scores_are_the_surrogate_on_the_attention_input(model, hf, prompts, kind, linear_path,
                                                                       mlp_path):
    """At prefill every token's score is the layer's surrogate on its attention input, as transformers computes
    that input (kvpress KVzapPress over kwargs hidden_states), across prefill chunks."""
    path = linear_path if kind == "linear" else mlp_path
    ids = prompts[0]
    method = build_method("kvzap", 10_000, surrogate=kind, path=path)
    engine, slot = prefill(model, method, ids)
    net = load_surrogate(path)
    for li, h in enumerate(hf_attention_inputs(hf, ids)):
        want = net.layers[li](h).T  # [H, N]
        torch.testing.assert_close(method.state(slot, li)["scores"][:, : len(ids)], want, atol=2e-5, rtol=1e-4)
    engine.end_sequence(slot)


# ---------------------------------------------------------------------------- the threshold rule
def kvpress_dms_masked(step_scores, window, threshold):
    """kvpress DMSPress.forward_hook's rule on one (layer, kv-head): step_scores is the list of each forward's new
    scores (the prompt's, then one per decode step); the buffer keeps the newest `window`; a score that leaves it
    below the threshold masks its token. Returns the masked token indices."""
    buffer, masked, seen = torch.empty(0), set(), 0
    for s in step_scores:
        buffer = torch.cat([buffer, s])
        seen += len(s)
        if len(buffer) > window:
            n = len(buffer) - window
            out, buffer = buffer[:n], buffer[n:]
            shift = seen - n - window
            masked |= {shift + int(i) for i in torch.where(out < threshold)[0]}
    return masked


@pytest.mark.parametrize("decode", ["none", "evict"])
@pytest.mark.parametrize("window", [0, 16])
def test_dms_over_kvzap_keeps_kvpress_dms_sets(model, prompts, linear_path, decode, window):
    """Every token scored at arrival; kept = not masked by kvpress's DMSPress rule (decoding=True with
    decode=evict), per (layer, kv-head), after prefill and after decoding."""
    ids, new = prompts[1], 12
    method = build_method("dms", None, base="kvzap", base_options={"surrogate": "linear", "path": linear_path},
                          threshold=0.0, sliding_window_size=window, decode=decode)
    arrivals = {}  # (layer, step) -> [H, Q] scores of the step's new tokens
    inner = method.inner
    orig = inner.observe

    def observe(obs):
        orig(obs)
        Q = obs.step_query_positions.shape[0]
        s = inner.state(obs.slot, obs.layer)["scores"]
        lengths = obs.lengths
        idx = lengths[:, None] - Q + torch.arange(Q)[None, :]
        arrivals.setdefault(obs.layer, []).append(s.gather(1, idx).clone())

    inner.observe = observe
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=4096)
    kept = positions_at_end(engine, method)
    gen = engine.generate([ids], max_new_tokens=new)[0]
    L, H = engine.cache.num_layers, engine.cache.num_kv_heads
    total = len(ids) + len(gen.token_ids) - 1
    n_chunks = math.ceil(len(ids) / CHUNK)
    for li in range(L):
        steps = arrivals[li]
        prompt = torch.cat(steps[:n_chunks], dim=1)  # [H, P]
        later = steps[n_chunks:] if decode == "evict" else []
        for h in range(H):
            masked = kvpress_dms_masked([prompt[h]] + [s[h] for s in later], window, 0.0)
            want = sorted(set(range(total)) - masked)
            assert kept["pos"][li][h] == want, (li, h)
    if window == 0:  # something was evicted, and the blocks went back
        assert any(len(p) < total for row in kept["pos"] for p in row)
    assert engine.cache.pool.in_use == 0


@pytest.mark.parametrize("base,opts", [("knorm", {}), ("kvzap", {"surrogate": "linear"}), ("snapkv", {"window": 8})])
def test_a_higher_threshold_never_keeps_more(model, prompts, linear_path, base, opts):
    """Kept sets are nested: every token kept at a higher threshold is kept at a lower one (and so the realized
    kept fraction falls as the threshold rises)."""
    if base == "kvzap":
        opts = dict(opts, path=linear_path)
    ids = prompts[0]
    fractions, sets = [], []
    engine, slot = prefill(model, build_method("dms", None, base=base, base_options=opts, threshold=-1e9), ids)
    scores = torch.cat([engine.method.state(slot, li)["dms_scores"].flatten() for li in range(engine.cache.num_layers)])
    engine.end_sequence(slot)
    qs = torch.quantile(scores.float(), torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])).tolist()
    for t in qs:
        method = build_method("dms", None, base=base, base_options=opts, threshold=t, sliding_window_size=4)
        engine, slot = prefill(model, method, ids)
        sets.append(kept_positions(engine, slot))
        fractions.append(method.prompt_kept_fraction(slot))
        engine.end_sequence(slot)
    for lo, hi in zip(sets, sets[1:]):
        for li in range(len(lo)):
            for h in range(len(lo[li])):
                assert set(hi[li][h]) <= set(lo[li][h])
    assert all(a >= b for a, b in zip(fractions, fractions[1:])) and fractions[0] > fractions[-1]


def test_dms_frees_evicted_blocks(model, prompts):
    """Streaming prefill with a threshold that drops about half: the peak is below an uncompressed cache's."""
    full = Engine(model, None, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=4096)
    full.generate(prompts, max_new_tokens=8)
    method = build_method("dms", None, base="knorm", threshold=-1e9, sliding_window_size=8, prefill_mode="streaming")
    engine, slot = prefill(model, method, prompts[0])
    s = torch.cat([method.state(slot, li)["dms_scores"][:, :-8].flatten() for li in range(engine.cache.num_layers)])
    median = float(s.median())
    engine.end_sequence(slot)
    method = build_method("dms", None, base="knorm", threshold=median, sliding_window_size=8, prefill_mode="streaming")
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=4096)
    gens = engine.generate(prompts, max_new_tokens=8)
    assert engine.memory_stats()["peak_kv_bytes"] < full.memory_stats()["peak_kv_bytes"]
    assert engine.cache.pool.in_use == 0
    stats = method.prefill_stats()
    assert 0.2 < stats["kv_kept_fraction"] < 0.9
    # per sample: the prompt's own fraction, which average (weighted by prompt length) to the run's
    per = [g.kv_kept_fraction for g in gens]
    assert all(p is not None and 0 < p < 1 for p in per)
    weighted = sum(p * len(ids) for p, ids in zip(per, prompts)) / sum(len(ids) for ids in prompts)
    assert abs(weighted - stats["kv_kept_fraction"]) < 2e-3


def test_dms_keeps_an_uncompressed_question(model, prompts):
    """The query-agnostic protocol: a question appended after compression is never evicted, even while decoding."""
    ids, tail = prompts[0], 20
    method = build_method("dms", None, base="knorm", threshold=1e9, sliding_window_size=4, decode="evict")
    engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=4096)
    kept = positions_at_end(engine, method)
    engine.generate([ids], max_new_tokens=10, uncompressed_tails=[tail])
    question = set(range(len(ids) - tail, len(ids)))
    for row in kept["pos"]:
        for p in row:
            assert question <= set(p)
            assert len(set(p) - question) == 4  # threshold +1e9: only the window of the newest 4 besides


# ---------------------------------------------------------------------------- KVzip+
def eager_attentions(hf, ids):
    """transformers' attention probabilities of a full forward over ids ([L][1, Hq, N, N]), run eagerly (the SDPA
    path returns none); hf's attention implementation is restored after."""
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(before)


def kvzip_plus_reference(hf, ctx):
    """kvpress KVzipPress(kvzip_plus_normalization=True), one chunk, no prefix: attention of the reconstruction
    queries / ||h_query|| x ||W_o,head v_key||, maxed over the queries and each kv-head's query heads -> [L, H, n]."""
    tok = ByteTokenizer(VOCAB)
    ids = ctx + tok.encode(FIRST_PROMPT) + tok.encode("\n") + ctx
    hidden = hf_attention_inputs(hf, ids)
    att = eager_attentions(hf, ids)
    n, H = len(ctx), hf.config.num_key_value_heads
    Hq = hf.config.num_attention_heads
    G, D = Hq // H, hf.config.head_dim
    out = []
    for li, a in enumerate(att):
        attn = hf.model.layers[li].self_attn
        with torch.no_grad():
            v = attn.v_proj(hidden[li]).view(-1, H, D).transpose(0, 1)  # [H, N, D]
            Wo = attn.o_proj.weight.T.view(H, G, D, -1)  # [H, G, D, E]
            wov = torch.einsum("hgdj,htd->hgtj", Wo, v).norm(dim=-1)  # [H, G, N]
        p = a[0].view(H, G, len(ids), len(ids)) / hidden[li].norm(dim=-1)[None, None, :, None]
        p = p * wov[:, :, None, :]
        out.append(p[:, :, n:, :n].amax(dim=(1, 2)))
    return torch.stack(out)


def test_kvzip_plus_scores_match_kvpress(model, hf, prompts):
    ctx = prompts[2][:60]
    method = build_method("kvzip", 10_000, kvzip_plus_normalization=True)
    engine, slot = prefill(model, method, ctx, chunk=64)
    ref = kvzip_plus_reference(hf, ctx)
    for layer in range(ref.shape[0]):
        got = method.state(slot, layer)["scores"]
        torch.testing.assert_close(got[:, 4:], ref[layer][:, 4:], atol=1e-5, rtol=1e-4)
        assert bool(torch.isinf(got[:, :4]).all())  # the sinks: always kept
    engine.end_sequence(slot)


# ---------------------------------------------------------------------------- training
def test_collector_targets_are_kvzap_data_kvzip_plus(model, hf, prompts):
    """kvzap/data.py's targets: log of the KVzip+ score of each token of the text's first copy, from the repeat's
    queries (here without a chat template: text + REPEAT + newline + text)."""
    tok = DecodingByteTokenizer(VOCAB)
    text_ids = prompts[2][:40]
    text = "".join(chr(65 + i % 26) for i in text_ids)
    model.tokenizer = tok
    X, y = kvzap_train.collect(model, tok, [text], n_tokens=1000, progress=False)
    ids, ps, pe, rs, re = kvzap_train.repeat_prompt(tok, text)
    assert ids[ps:pe] == ids[rs:re] and pe - ps == len(text)
    ref = kvzip_plus_reference_ids(hf, ids, ps, pe, rs, re)  # [L, H, n]
    hidden = hf_attention_inputs(hf, ids)
    # rows are a random permutation of the text's tokens: match them by their attention inputs in every layer
    every = torch.cat([h[ps:pe] for h in hidden], dim=-1)  # [n, L * E]
    order = [int(torch.cdist(X[i:i + 1].flatten(1), every).argmin()) for i in range(X.shape[0])]
    assert sorted(order) == list(range(pe - ps))
    torch.testing.assert_close(y, torch.log(ref[:, :, order]).permute(2, 0, 1), atol=1e-4, rtol=1e-4)


def kvzip_plus_reference_ids(hf, ids, ps, pe, rs, re):
    hidden = hf_attention_inputs(hf, ids)
    att = eager_attentions(hf, ids)
    H, Hq, D = hf.config.num_key_value_heads, hf.config.num_attention_heads, hf.config.head_dim
    G, N = Hq // H, len(ids)
    out = []
    for li, a in enumerate(att):
        attn = hf.model.layers[li].self_attn
        with torch.no_grad():
            v = attn.v_proj(hidden[li]).view(N, H, D).transpose(0, 1)
            Wo = attn.o_proj.weight.T.view(H, G, D, -1)
            wov = torch.einsum("hgdj,htd->hgtj", Wo, v).norm(dim=-1)  # [H, G, N]
        p = a[0].view(H, G, N, N) / hidden[li].norm(dim=-1)[None, None, :, None] * wov[:, :, None, :]
        out.append(p[:, :, rs:re, ps:pe].amax(dim=(1, 2)))
    return torch.stack(out)


def test_linear_fit_is_sklearn_ridge():
    Ridge = pytest.importorskip("sklearn.linear_model").Ridge
    g = torch.Generator().manual_seed(0)
    X = torch.randn(300, 3, 12, generator=g)
    y = torch.randn(300, 3, 2, generator=g) + X[:, :, :2] * 0.5
    net = kvzap_train.train_linear(X, y)
    for li in range(3):
        r = Ridge().fit(X[:, li].numpy(), y[:, li].numpy())
        torch.testing.assert_close(net.layers[li].weight.data, torch.tensor(r.coef_, dtype=torch.float32),
                                   atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(net.layers[li].bias.data, torch.tensor(r.intercept_, dtype=torch.float32),
                                   atol=1e-5, rtol=1e-4)


def test_mlp_fit_learns():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2000, 2, 8, generator=g)
    y = torch.stack([X[:, :, 0].abs(), X[:, :, 1] * X[:, :, 2]], dim=-1)  # [N, 2, 2]
    net = kvzap_train.train_mlp(X, y, hidden_dim=32, max_epochs=15, batch_size=128)
    with torch.no_grad():
        mse = float(torch.nn.functional.mse_loss(net(X), y))
    assert mse < 0.5 * float(y.var())


def test_train_writes_loadable_surrogates_for_any_model(model, tmp_path, monkeypatch, prompts):
    """kvbench-train-kvzap's train() on the tiny model: both surrogates in the hub's format, usable by kvzap."""
    tok = DecodingByteTokenizer(VOCAB)
    text = "".join(chr(97 + i % 26) + (" " if i % 5 == 0 else "") for i in range(3000))
    monkeypatch.setattr("kvbench.data.essay_corpus_text", lambda: text)
    mse = kvzap_train.train(model, tok, tmp_path / "out", n_texts=3, min_tokens=60, max_tokens=80, n_tokens=40,
                            hidden_dim=16, max_epochs=2, progress=False)
    assert set(mse) == {"linear", "mlp", "target_var"}
    for kind in ("linear", "mlp"):
        method = build_method("kvzap", 32, surrogate=kind, path=str(tmp_path / "out" / kind))
        engine = Engine(model, method, block_size=BS, prefill_chunk_size=CHUNK, num_blocks=4096)
        engine.generate(prompts[:1], max_new_tokens=4)
        assert engine.memory_stats()["peak_kv_bytes"] > 0


# ---------------------------------------------------------------------------- bad input
def test_bad_input_is_one_line(model, linear_path, tmp_path):
    with pytest.raises(UserError, match="surrogate='quadratic'"):
        build_method("kvzap", 32, surrogate="quadratic")
    with pytest.raises(UserError, match="threshold"):
        build_method("dms", None, base="knorm")
    with pytest.raises(UserError, match="threshold='x'"):
        build_method("dms", None, base="knorm", threshold="x")
    with pytest.raises(UserError, match="both set"):
        build_method("dms", 64, base="knorm", threshold=0.0)
    with pytest.raises(UserError, match="both set"):
        build_method("dms", None, compression_ratio=0.5, base="knorm", threshold=0.0)
    with pytest.raises(UserError, match="base='nope'"):
        build_method("dms", None, base="nope", threshold=0.0)
    with pytest.raises(UserError, match="not a hub id"):
        load_surrogate(str(tmp_path / "missing"))
    bad = KVzapSurrogate(7, 2, 1, None)
    bad.save(tmp_path / "bad")
    method = build_method("kvzap", 32, surrogate="linear", path=str(tmp_path / "bad"))
    with pytest.raises(UserError, match="does not fit"):
        Engine(model, method, block_size=BS, num_blocks=64)
    method = build_method("kvzap", 32, surrogate="mlp", path=linear_path)
    with pytest.raises(UserError, match="surrogate loaded is linear"):
        Engine(model, method, block_size=BS, num_blocks=64)


@pytest.mark.parametrize("overrides,match", [
    (["method=dms", "method.base=knorm", "method.threshold=abc"], "invalid method.threshold='abc'"),
    (["method=dms", "method.base=knorm", "method.threshold=-3", "budget=64"], "both set"),
    (["method=dms", "method.base=knorm", "method.threshold=-3", "compression_ratio=0.5"], "both set"),
])
def test_config_refuses_a_threshold_with_a_budget(overrides, match):
    from hydra import compose, initialize_config_dir

    from kvbench.run.config import validate
    import os

    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(UserError, match=match):
        validate(cfg)


def test_packaged_surrogate_is_trained_once_into_the_cache(model, tmp_path, monkeypatch, capsys):
    """kvzap on the packaged model (no path, no hub name): trained into the cache on first use, announced with its
    time; the next use loads it."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kvzap_train, "PACKAGED_SETTINGS", dict(n_texts=2, min_tokens=60, max_tokens=80, n_tokens=40))
    text = "".join(chr(97 + i % 26) + (" " if i % 5 == 0 else "") for i in range(3000))
    monkeypatch.setattr("kvbench.data.essay_corpus_text", lambda: text)
    tok = DecodingByteTokenizer(VOCAB)
    net = kvzap_train.ensure_packaged(model, tok, "linear")
    err = capsys.readouterr().err
    assert "training KVzap surrogates for the packaged model" in err and "trained in" in err
    assert (tmp_path / "kvzap" / "smollm2-135m" / "mlp" / "config.json").exists() and net.kind == "linear"

    def no_training(*a, **k):
        raise AssertionError("trained again")

    monkeypatch.setattr(kvzap_train, "train", no_training)
    model.tokenizer = tok
    method = build_method("kvzap", 32, surrogate="mlp")  # no path, no name_or_path: the packaged model's
    Engine(model, method, block_size=BS, num_blocks=64)
    assert method.net.kind == "mlp" and "training" not in capsys.readouterr().err


def test_the_packaged_surrogates_are_written_whole_or_not_at_all(tmp_path, monkeypatch, hf):
    """First use trains both surrogates into a temporary folder that replaces the cache's at once (atomic_write):
    a training that fails leaves no folder behind, and the next use trains again."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    cfg = hf.config

    def fake_train(model, tokenizer, output_dir, **settings):
        for name, hidden in (("linear", None), ("mlp", 16)):
            KVzapSurrogate(cfg.hidden_size, cfg.num_key_value_heads, cfg.num_hidden_layers, hidden).save(
                f"{output_dir}/{name}")
        return {"linear": 0.0, "mlp": 0.0}

    def failing_train(model, tokenizer, output_dir, **settings):
        fake_train(model, tokenizer, output_dir)
        raise UserError("interrupted after writing")

    folder = kvzap_train.packaged_folder("mlp")
    monkeypatch.setattr(kvzap_train, "train", failing_train)
    with pytest.raises(UserError):
        kvzap_train.ensure_packaged(None, object(), "mlp")
    assert not folder.exists() and list(folder.parent.parent.iterdir()) == []  # no half-trained folder left
    monkeypatch.setattr(kvzap_train, "train", fake_train)
    net = kvzap_train.ensure_packaged(None, object(), "mlp")
    assert isinstance(net, KVzapSurrogate) and (folder.parent / "linear" / "config.json").exists()
