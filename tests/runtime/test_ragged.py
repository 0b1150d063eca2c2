"""A ragged step (prefill chunks and decode tokens of many sequences in one forward, Engine.step) equals the same
sequences run one by one: the same logits and the same cache contents, for every method and every codec, with
random mixes of chunk lengths and decode tokens (hypothesis). Tolerances: fp32 throughout; the flat batch changes
the GEMM shapes, so results agree to rounding (logits atol 2e-4, cached K/V atol 1e-4; fp16-coded K/V to fp16 steps), not bit for bit."""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.methods import build_method
from kvbench.quant.codecs import Fp8Codec, Int8Codec, KiviCodec
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.quant.rotation import RotatedCodec
from kvbench.quant.registry import build_codec
from kvbench.runtime.serving.engine import Engine, Segment
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.tiny_models import HEAD_DIM_64, SMOLLM2_TOKEN_IDS, tiny_model

BS = 8
METHODS = [("full", None, {}), ("paged_eviction", 32, {}), ("streaming_llm", 24, {}), ("h2o", 24, {}),
           ("snapkv", 24, {"window": 8}), ("key_diff", 32, {}), ("kvcrush", 24, {"prefill_mode": "streaming"})]
CODECS = {
    "kivi2": lambda: KiviCodec(2, group_size=8, residual=16),
    "kivi4": lambda: KiviCodec(4, group_size=8, residual=8),
    "int8": lambda: Int8Codec(),
    "fp8": lambda: Fp8Codec(),
    "nvfp4": lambda: Nvfp4Codec(),
    "mxfp4": lambda: Mxfp4Codec(),
    "kivi2_hadamard": lambda: RotatedCodec(KiviCodec(2, group_size=8, residual=16), seed=0),
    "kvquant_uniform": lambda: build_codec("kvquant", None, levels="uniform", key_ranges="online", bits=4),
}

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=256, max_positions=1024, **SMOLLM2_TOKEN_IDS)


def _engine(model, method, codec, backend="auto"):
    name, budget, opts = method
    return Engine(model, build_method(name, budget, **opts), codec=codec() if codec else None, block_size=BS,
                  num_blocks=4096, prefill_chunk_size=64, attention_backend=backend)


def _tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _history(engine, histories):
    """Sequences with the given token histories, fed one by one: a prompt chunk, then decode steps."""
    slots = []
    for i, (prompt, decoded) in enumerate(histories):
        s = engine.new_sequence()
        engine.forward_chunk(s, prompt, 0)
        for j, t in enumerate(decoded):
            engine.step([Segment(s, [t], len(prompt) + j, "decode")])
        slots.append(s)
    return slots


def _contents(engine, slots):
    out = []
    for s in slots:
        for layer in range(engine.model.config.num_layers):
            k, v, pos = engine.cache.gather(layer, s)
            out.append((engine.cache.lengths[s, layer].clone(), pos, k, v))
    return out


def _check_ragged_equals_one_by_one(model, method, codec, spec, backend="auto"):
    """spec: per sequence (prompt length, decoded tokens, this step: ("prefill", n, last) or ("decode",))."""
    histories, segs_of = [], []
    for i, (plen, ndec, what) in enumerate(spec):
        prompt = _tokens(plen, 100 + i)
        decoded = _tokens(ndec, 200 + i)
        histories.append((prompt, decoded))
        pos = plen + ndec
        if what[0] == "decode":
            segs_of.append(lambda s, t=_tokens(1, 300 + i), p=pos: Segment(s, t, p, "decode"))
        else:
            segs_of.append(lambda s, t=_tokens(what[1], 300 + i), p=pos, last=what[2]: Segment(s, t, p, "prefill",
                                                                                                 last))
    ragged, single = _engine(model, method, codec, backend), _engine(model, method, codec, backend)
    slots_r, slots_s = _history(ragged, histories), _history(single, histories)
    assert slots_r == slots_s
    got = ragged.step([f(s) for f, s in zip(segs_of, slots_r)])
    want = [single.step([f(s)])[0] for f, s in zip(segs_of, slots_s)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    if codec is not None:  # one by one, a later sequence's step packs what an earlier one's step filled: align
        ragged.cache.pack_pending()
        single.cache.pack_pending()
    # A codec keeps its residual blocks and its scales in fp16: an fp32 rounding difference of 1e-6 can move a stored
    # value one fp16 step (2^-11 at magnitude 0.5-1), so coded contents agree to fp16 steps, plain ones to 1e-4.
    atol, rtol = (2e-3, 1e-3) if codec is not None else (1e-4, 1e-4)
    for (lr, pr, kr, vr), (ls, ps, ks, vs) in zip(_contents(ragged, slots_r), _contents(single, slots_s)):
        assert torch.equal(lr, ls) and torch.equal(pr, ps)
        torch.testing.assert_close(kr, ks, atol=atol, rtol=rtol)
        torch.testing.assert_close(vr, vs, atol=atol, rtol=rtol)


_SPEC = st.lists(st.tuples(st.integers(1, 60), st.integers(0, 6),
                           st.one_of(st.just(("decode",)),
                                     st.tuples(st.just("prefill"), st.integers(1, 40), st.booleans()))),
                 min_size=2, max_size=5)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_SPEC)
@pytest.mark.parametrize("method", METHODS, ids=[m[0] + "_" + str(m[2]) for m in METHODS])
def test_ragged_step_equals_one_by_one_for_every_method(model, method, spec):
    _check_ragged_equals_one_by_one(model, method, None, spec)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=_SPEC)
@pytest.mark.parametrize("codec", list(CODECS))
def test_ragged_step_equals_one_by_one_for_every_codec(model, codec, spec):
    _check_ragged_equals_one_by_one(model, ("full", None, {}), CODECS[codec], spec)


@pytest.mark.parametrize("codec", ["nvfp4", "mxfp4", "kivi2_hadamard"])
@pytest.mark.parametrize("method", METHODS[1:], ids=[m[0] for m in METHODS[1:]])
def test_eviction_methods_over_the_fp4_and_rotated_codecs(model, method, codec):
    """Every eviction method of the matrix over the FP4 codecs and a rotated KIVI: a ragged step still equals one by
    one (prompts past the budgets, so the methods evict over packed blocks)."""
    spec = [(60, 4, ("decode",)), (50, 0, ("prefill", 20, True)), (45, 2, ("decode",))]
    _check_ragged_equals_one_by_one(model, method, CODECS[codec], spec)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_ragged_step_on_each_cpu_backend(model, backend):
    spec = [(20, 3, ("decode",)), (9, 0, ("prefill", 17, True)), (33, 1, ("decode",)), (5, 0, ("prefill", 17, False))]
    _check_ragged_equals_one_by_one(model, ("full", None, {}), None, spec, backend)


def test_hooks_see_each_group_as_its_own_step(model):
    """A mixed step calls after_attention once per layer and group: the decode tokens together, each prefill chunk
    length on its own, with the rectangular q and plan a step of that group alone would give."""
    seen = []

    class Spy:
        name, needs_key_scores, acts_after_attention, store_pre_rope, rope_mode = "spy", False, True, False, \
            "original"

        def attach(self, cache, cfg):
            pass

        def after_attention(self, ctx):
            seen.append((ctx.layer, ctx.phase, ctx.last_chunk, tuple(ctx.q.shape), ctx.plan.slot_list))

        def on_sequence_end(self, slot):
            pass

    engine = Engine(model, Spy(), block_size=BS, num_blocks=512)
    a, b, c = (engine.new_sequence() for _ in range(3))
    for s in (a, b):
        engine.forward_chunk(s, _tokens(10, s), 0)
    seen.clear()
    engine.step([Segment(a, [1], 10, "decode"), Segment(c, _tokens(7, 9), 0, "prefill", False),
                 Segment(b, [2], 10, "decode")])
    Hq, D = model.config.num_heads, model.config.head_dim
    assert seen == [(li, ph, last, shape, slots) for li in range(model.config.num_layers)
                    for ph, last, shape, slots in (("decode", True, (2, Hq, 1, D), [a, b]),
                                                   ("prefill", False, (1, Hq, 7, D), [c]))]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton attention on CPU needs "
                    "TRITON_INTERPRET=1 (run: TRITON_INTERPRET=1 pytest tests/runtime/test_ragged.py -k triton)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_forward_with_the_triton_kernel(dtype):
    """forward_ragged with the Triton paged attention (interpreted on CPU) equals the torch reference."""
    pytest.importorskip("triton")
    from kvbench.runtime.backends.triton.backend import TritonBackend
    from kvbench.runtime.cache.kv_cache import PagedKVCache
    from kvbench.runtime.model.forward import RaggedGroup

    model = tiny_model(vocab=256, max_positions=1024, dtype=dtype, **SMOLLM2_TOKEN_IDS)
    cfg = model.config
    outs = []
    for backend in (None, TritonBackend()):
        cache = PagedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                             block_size=BS, num_blocks=256, dtype=dtype)
        slots = [cache.add_sequence() for _ in range(3)]
        groups = []
        for s, (n, start) in zip(slots, [(13, 0), (1, 0), (6, 0)]):
            toks = torch.tensor([_tokens(n, s)])
            groups.append(RaggedGroup(toks, cache.prepare_append([s], torch.arange(start, start + n)[None])))
        kw = {} if backend is None else {"backend": backend}
        outs.append(torch.cat(model.forward_ragged(groups, cache, **kw)))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)


@pytest.mark.parametrize("codec", [None, "kivi2", "int8"])
def test_ragged_step_with_the_c_kernels_at_head_dim_64(codec):
    """Head dim 64, so the C kernels run inside the ragged step (decode kernel for the decode group, prefill kernel
    for later chunks, codec kernels over packed blocks): still equal to one by one."""
    model64 = tiny_model(vocab=256, **HEAD_DIM_64)
    spec = [(70, 3, ("decode",)), (40, 0, ("prefill", 29, True)), (90, 2, ("decode",)), (33, 0, ("prefill", 29, False)),
            (1, 0, ("prefill", 12, True))]
    _check_ragged_equals_one_by_one(model64, ("full", None, {}), CODECS[codec] if codec else None, spec, "cpu")
