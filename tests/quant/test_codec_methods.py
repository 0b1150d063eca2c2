"""The codec registry, the codec methods (kivi, kvquant, int8, fp8) end to end on a tiny model, their configs,
and the KVQuant calibration (the capturing forward, Fisher weights, the disk cache)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec, KVQuantCodec
from kvbench.quant.registry import OPTIONS, build_codec
from kvbench.runtime.cache.quantized_cache import QuantizedPagedKVCache
from kvbench.runtime.serving.engine import Engine
from kvbench.runtime.serving.scoring import Scorer
from kvbench.run.spec import codec_names, resolve_storage
from tests.tiny_models import SHARP_LOGITS, tiny_model

CONF = Path(__file__).resolve().parents[2] / "conf"
CAL = dict(calibration_sequences=2, calibration_tokens=96)  # a small calibration for the tiny model


class ByteTokenizer:
    """Characters -> ids below 256 (the tiny model's vocabulary)."""

    def __call__(self, text):
        return {"input_ids": [ord(c) % 256 for c in text]}


@pytest.fixture(scope="module")
def tiny():
    # the tokenizer: what kvquant calibration tokenizes its text with
    return tiny_model(vocab=256, max_positions=2048, tokenizer=ByteTokenizer(), **SHARP_LOGITS)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _ids(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------------- registry
def test_build_codec_by_name():
    assert build_codec("none") is None and build_codec("full") is None
    assert isinstance(build_codec("int8"), Int8Codec) and isinstance(build_codec("fp8"), Fp8Codec)
    c = build_codec("kivi", bits=4, group_size=16, residual=None, key_axis="token")
    assert isinstance(c, KiviCodec) and (c.bits, c.group_size, c.residual, c.key_axis) == (4, 16, 128, "token")
    u = build_codec("kvquant", levels="uniform", key_ranges="online", outlier_fraction=0)
    assert isinstance(u, KVQuantCodec) and u.levels == "uniform" and u.key_ranges is None and u.pre_rope_keys


@pytest.mark.parametrize("name,options,words", [
    ("zstd", {}, ["'zstd'"] + codec_names()),
    ("kivi", {"bitz": 2}, ["bitz", "bits", "group_size", "residual", "key_axis"]),
    ("int8", {"bits": 8}, ["bits", "int8"]),
    ("kivi", {"bits": 3}, ["kivi", "bits=3"]),
    ("kivi", {"residual": 100}, ["kivi", "residual"]),
    ("kvquant", {"levels": "nf"}, ["levels", "nuq", "uniform"]),
    ("kvquant", {"calibration": "hessian", "levels": "uniform"}, ["calibration", "fisher", "kmeans"]),
])
def test_build_codec_errors_are_one_line_with_the_choices(name, options, words):
    with pytest.raises(UserError) as err:
        build_codec(name, None, **options)
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_kvquant_nuq_needs_a_model_or_a_tokenizer(tiny):
    with pytest.raises(UserError, match="model"):
        build_codec("kvquant")
    model_without_tokenizer = type(tiny).__new__(type(tiny))
    model_without_tokenizer.__dict__.update({k: v for k, v in vars(tiny).items() if k != "tokenizer"})
    with pytest.raises(UserError, match="tokenizer"):
        build_codec("kvquant", model_without_tokenizer, **CAL)


# ---------------------------------------------------------------------------------------------------- methods
def test_codec_methods_are_shorthands_for_quant():
    """method=<codec> is method=full quant=<codec>; the method's options are the codec's."""
    route = resolve_storage("kivi", dict(bits=4, group_size=16, residual=64, key_axis="token"), "none", {})
    assert route == ("full", {}, "kivi", dict(bits=4, group_size=16, residual=64, key_axis="token"))
    c = build_codec(route[2], None, **route[3])
    assert isinstance(c, KiviCodec) and (c.bits, c.group_size, c.residual, c.key_axis) == (4, 16, 64, "token")
    assert resolve_storage("int8", {}, None, {})[2:] == ("int8", {})
    assert resolve_storage("paged_eviction", {"heads": "shared"}, "kivi", {"bits": 4}) == (
        "paged_eviction", {"heads": "shared"}, "kivi", {"bits": 4})
    assert isinstance(build_codec("fp8", None), Fp8Codec) and isinstance(build_codec("int8", None), Int8Codec)
    k = build_codec("kvquant", None, levels="uniform", key_ranges="online", bits=2)
    assert isinstance(k, KVQuantCodec) and k.bits == 2


@pytest.mark.parametrize("method,quant", [("kivi", "int8"), ("int8", "kivi"), ("kvquant", "kivi"), ("fp8", "fp8")])
def test_a_method_and_a_quant_both_naming_a_codec_is_an_error(method, quant):
    with pytest.raises(UserError, match=f"method={method} and quant={quant} both choose a storage codec"):
        resolve_storage(method, {}, quant, {})


@pytest.mark.parametrize("name,options", [("kivi", {"bits": 5}), ("kivi", {"key_axis": "head"}),
                                          ("kvquant", {"bits": 8}), ("kvquant", {"outlier_fraction": 1.5}),
                                          ("kvquant", {"calibration_corpus": "essays"}), ("int8", {"bits": 4}),
                                          ("nvfp4", {"tensor_amax": "big"}), ("nvfp4", {"tensor_amax": -2.0}),
                                          ("mxfp4", {"rotate": "spin"}), ("kivi", {"rotate_seed": 1.5}),
                                          ("mxfp4", {"tensor_amax": 3.0})])
def test_codecs_refuse_bad_settings_without_a_model(name, options):
    from kvbench.quant.registry import check_codec

    with pytest.raises(UserError):
        check_codec(name, options)


def _workload(engine, ids):
    lp = Scorer(engine).score(ids, chunk_size=32)
    gens = engine.generate([ids[:70], ids[:40]], max_new_tokens=8)
    return lp, gens, engine.memory_stats()


@pytest.fixture(scope="module")
def full_run(tiny):
    ids = _ids(128, seed=1)
    # prefill_first: one prompt's chunk in full precision at a time (the mixed schedule prefills both prompts of
    # the workload in one step, so both sit in full precision until the next step packs them)
    return ids, _workload(Engine(tiny, num_blocks=256, schedule="prefill_first"), ids)


@pytest.mark.parametrize("name,options,tol", [
    ("kivi", dict(bits=4, group_size=16, residual=32), 0.08),
    ("kvquant", dict(bits=4, **CAL), 0.08),
    ("int8", {}, 0.02),
    ("fp8", {}, 0.05),
    ("nvfp4", {}, 0.15),
    ("mxfp4", {}, 0.2),
    ("mxfp4", dict(rotate="hadamard"), 0.2),
])
def test_codec_method_end_to_end(tiny, full_run, name, options, tol):
    ids, (ref, _, full_stats) = full_run
    eng = Engine(tiny, codec=build_codec(name, tiny, **options), num_blocks=256, schedule="prefill_first")
    assert isinstance(eng.cache, QuantizedPagedKVCache) and eng.cache.codec.name == name
    assert eng.cache.codec.describe().get("rotate", "none") == options.get("rotate", "none")
    assert eng.cache.describe_storage()["codec"] == name
    lp, gens, stats = _workload(eng, ids)
    err = (lp - ref).abs().mean()
    assert 0 < err < tol
    assert [len(g.token_ids) for g in gens] == [8, 8]
    assert stats["peak_kv_bytes"] < full_stats["peak_kv_bytes"] * 0.75
    assert stats["full_kv_bytes"] >= full_stats["full_kv_bytes"]
    assert eng.cache.pool.in_use == 0


# ---------------------------------------------------------------------------------------------------- calibration
def test_capture_forward_is_the_runtime_forward(tiny):
    """forward_capture runs the runtime model; its logits and pre-RoPE keys match a pre-RoPE paged cache."""
    from kvbench.quant.calibration import forward_capture
    from kvbench.runtime.cache.kv_cache import PagedKVCache

    ids = _ids(100, seed=2)
    logits, keys, values, kg, vg = forward_capture(tiny, torch.tensor(ids), grads=True)
    lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), Scorer(Engine(tiny, num_blocks=64)).score(ids), atol=1e-4, rtol=1e-4)
    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=64, store_pre_rope=True)
    s = cache.add_sequence()
    plan = cache.prepare_append([s], torch.arange(100).unsqueeze(0))
    with torch.no_grad():
        tiny.forward(torch.tensor([ids]), cache, plan)
    for layer in range(2):
        k, v, _ = cache.gather(layer, s)
        torch.testing.assert_close(k, keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, values[layer], atol=1e-5, rtol=1e-5)
        assert kg[layer].shape == keys[layer].shape and bool((kg[layer] > 0).any())
    # Fisher weights: the last position's K/V cannot change any scored prediction except through itself
    assert float(vg[0][:, -1].sum()) == 0.0 and float(vg[0][:, 0].sum()) > 0


def test_fisher_and_kmeans_levels_differ_and_are_cached(tiny, cache_dir):
    from kvbench.quant.calibration import CalibrationSettings, calibrate

    fisher = build_codec("kvquant", tiny, **CAL)
    files = list((cache_dir / "kvquant").glob("*.pt"))
    assert len(files) == 1 and not fisher.calibration_info["cached"]
    again = build_codec("kvquant", tiny, **CAL)
    assert again.calibration_info["cached"] and torch.equal(again.key_levels, fisher.key_levels)
    kmeans = build_codec("kvquant", tiny, calibration="kmeans", **CAL)
    assert len(list((cache_dir / "kvquant").glob("*.pt"))) == 2
    assert not torch.allclose(kmeans.value_levels, fisher.value_levels, atol=1e-3)
    for lv in (fisher.key_levels, fisher.value_levels, kmeans.key_levels):
        assert lv.shape == (2, 8) and bool((lv.diff(dim=1) > 0).all()) and float(lv.abs().max()) <= 1
    r = fisher.key_ranges
    assert r.shape == (2, 2, 2, 16) and bool((r[:, :, 0] <= r[:, :, 1]).all())
    assert fisher.describe()["calibration"] == "fisher" and kmeans.describe()["calibration"] == "kmeans"
    # the cache key covers the bits: a 2-bit calibration is a new file with 4 levels
    two = calibrate(tiny, None, CalibrationSettings(bits=2, num_sequences=2, seq_len=96))
    assert two.key_levels.shape == (2, 4) and len(list((cache_dir / "kvquant").glob("*.pt"))) == 3


def test_calibration_text_is_not_the_evaluation_text(tiny):
    from kvbench.data.aclsum import load_aclsum
    from kvbench.data.essays import essay_corpus_text
    from kvbench.quant.calibration import CalibrationSettings, calibration_sequences

    s = CalibrationSettings(num_sequences=2, seq_len=96)
    seqs = calibration_sequences(ByteTokenizer(), s)
    train = load_aclsum("train", limit=2)
    assert [seq[:50] for seq in seqs] == [ByteTokenizer()(r["document"])["input_ids"][:50] for r in train]
    essays = essay_corpus_text()
    assert all(r["document"][:200] not in essays for r in train)


# ---------------------------------------------------------------------------------------------------- configs
@pytest.mark.parametrize("name", ["kivi", "kvquant", "int8", "fp8", "nvfp4", "mxfp4"])
def test_codec_method_configs_compose_to_full_plus_quant(name):
    """conf/method/<codec>.yaml pulls the quant group's options: method=<codec> method.<opt>=x runs as
    method=full quant=<codec> quant.<opt>=x (the same run)."""
    from kvbench.run.config import validate
    from tests.harness_fakes import compose

    def route(overrides):
        s = validate(compose(overrides))
        return resolve_storage(s.method_name, s.method_options, s.quant_name, s.quant_options)

    assert route([f"method={name}"]) == route(["method=full", f"quant={name}"])
    if name == "kivi":
        assert route(["method=kivi", "method.bits=4"]) == route(["quant=kivi", "quant.bits=4"])
        assert route(["method=kivi", "method.bits=4"])[3]["bits"] == 4


@pytest.mark.parametrize("name", ["none", "kivi", "kvquant", "int8", "fp8", "nvfp4", "mxfp4"])
def test_quant_configs_match_the_registry(name):
    cfg = yaml.safe_load((CONF / "quant" / f"{name}.yaml").read_text())
    assert cfg.pop("name") == name
    assert set(cfg) <= set(OPTIONS[name])
    assert cfg == {k: v for k, v in OPTIONS[name].items() if k in cfg}, "YAML and registry defaults differ"
    if name != "kvquant":
        codec = build_codec(name, None, **cfg)
        assert (codec is None) == (name == "none")
