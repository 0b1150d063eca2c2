"""The fused CPU decode layer (one C call per layer) gives the numbers of the op-by-op path, and runs exactly when
it may (kvbench/runtime/backends/cpu/fused_decode.py)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kvbench.quant.codecs import Int8Codec, KiviCodec
from kvbench.quant.fp4_codecs import Mxfp4Codec, Nvfp4Codec
from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.backends.cpu import quant_linear as ql
from kvbench.runtime.backends.cpu.quant_linear import QuantLinear
from kvbench.runtime.backends.cpu.backend import CPU
from kvbench.runtime.backends.torch.backend import TORCH
from kvbench.runtime.cache.caches import build_cache
from kvbench.runtime.cache.kv_cache import PagedKVCache
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.model.quantized_weights import set_quant_activations
from tests.fixtures.gguf_fixtures import write_gguf
from tests.tiny_models import HEAD_DIM_64, tiny_hf_model, tiny_model

CSRC = Path(cpu_kernels.__file__).parent / "csrc"

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def try_fused(backend, model, tokens, cache, plan, cos, sin, need_scores):
    """The backend's fused decode step over the model's and the cache's views, or None."""
    return backend.fused_decode(model.decode_weights(), tokens, cache.decode_pools(), plan, "original", cos, sin,
                                need_scores)


class RecordingHook:
    """Keeps what every after_attention call saw; optionally drops a layer's oldest full block (ragged heads)."""

    def __init__(self, needs_key_scores: bool, evict: bool = False):
        self.needs_key_scores, self.evict, self.seen = needs_key_scores, evict, []

    def after_attention(self, ctx) -> None:
        ks = None if ctx.key_scores is None else ctx.key_scores.clone()
        self.seen.append((ctx.layer, ctx.phase, None if ctx.q is None else ctx.q.clone(), ks))
        if self.evict and ctx.phase == "decode" and ctx.layer == 1:
            for i, slot in enumerate(ctx.plan.slot_list):
                lengths = ctx.plan.table_lengths(i, ctx.layer)
                if lengths[0] > 2 * ctx.cache.block_size:  # head 0 only: heads of different lengths
                    ctx.cache.evict_blocks(ctx.layer, slot, 0, [1])


# codec caches the fused step reads through the C codec decode kernel (new tokens land in fp16 full-precision
# blocks for KIVI, fp32 for int8); small residual windows, so blocks are packed during the decode steps too
CODECS = {
    "kivi2": lambda: KiviCodec(2, group_size=32, residual=32),
    "kivi4": lambda: KiviCodec(4, group_size=32, residual=64),
    "kivi8": lambda: KiviCodec(8, group_size=16, residual=32),
    "int8": lambda: Int8Codec(),
    "nvfp4": lambda: Nvfp4Codec(),
    "mxfp4": lambda: Mxfp4Codec(),
}


def new_cache(model, codec=None, block_size=4):
    cfg = model.config
    if codec is None:
        return PagedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                            block_size=block_size, num_blocks=800)
    return build_cache(codec=CODECS[codec](), kv_memory_bytes=2**23, num_layers=cfg.num_layers,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=16, dtype=torch.float32,
                       device="cpu")


def run(model, prompts, steps, *, fused, hook=None, block_size=4, codec=None):
    """Prefill each prompt, then `steps` greedy decode steps of the whole batch: (logits per step, the cache)."""
    model.fuse_decode_layers = fused
    cache = new_cache(model, codec, block_size)
    slots = [cache.add_sequence() for _ in prompts]
    nxt = []
    with torch.inference_mode():
        for s, p in zip(slots, prompts):
            plan = cache.prepare_append([s], torch.arange(len(p)).unsqueeze(0))
            logits = model.forward(torch.tensor([p]), cache, plan, backend=CPU, hook=hook)
            nxt.append(int(logits[0].argmax()))
        pos = [len(p) for p in prompts]
        out = []
        for _ in range(steps):
            plan = cache.prepare_append(slots, torch.tensor(pos).unsqueeze(1))
            used = try_fused(CPU, model, torch.tensor([nxt]).T, cache, plan, *model.rotary.lookup(plan.query_positions),
                             hook is not None and hook.needs_key_scores) is not None
            assert used == (fused and model.config.model_type != "qwen3")
            logits = model.forward(torch.tensor([nxt]).T, cache, plan, backend=CPU, hook=hook, phase="decode")
            out.append(logits)
            nxt = logits.argmax(-1).tolist()
            pos = [x + 1 for x in pos]
    return out, cache


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "tied", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_fused_decode_matches_the_op_by_op_path(family, batch):
    """Logits of every decode step and every cached K/V row agree (qwen3's q/k norms keep it unfused)."""
    model = tiny_model(family, seed=7)
    prompts = [[(7 * i + 3 * j) % 300 for j in range(20 + 13 * i)] for i in range(batch)]
    fused, cache_f = run(model, prompts, 12, fused=True)
    ref, cache_r = run(model, prompts, 12, fused=False)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert torch.equal(cache_f.tables, cache_r.tables) and torch.equal(cache_f.lengths, cache_r.lengths)
    for slot in cache_f.live:
        for layer in range(model.config.num_layers):
            for a, b in zip(cache_f.gather(layer, slot), cache_r.gather(layer, slot)):  # K, V, positions
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_decode_over_a_codec_cache_matches_the_op_by_op_path(codec, batch):
    """Over a codec cache the fused step reads packed and full-precision blocks with the codec decode kernel, as the
    op-by-op path does: the same logits and cached K/V while blocks leave the window and are packed. Layer 0's K/V
    (the same inputs on both paths) agree bit for bit: the fused fp16 write rounds as torch's cast and packs to the
    same codes. Later layers see last-bit differences of the MLP (C silu against torch's): up to an fp16 ulp, and a
    code that sat on a rounding boundary may flip (at most one element in 10,000 beyond an fp16 ulp)."""
    model = tiny_model(vocab=300, seed=3, **HEAD_DIM_64)
    prompts = [[(11 * i + 5 * j) % 300 for j in range(40 + 37 * i)] for i in range(batch)]
    fused, cache_f = run(model, prompts, 70, fused=True, codec=codec)
    ref, cache_r = run(model, prompts, 70, fused=False, codec=codec)
    assert cache_f.block_counts()["packed"] > 0 and cache_f.block_counts() == cache_r.block_counts()
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    for layer in range(model.config.num_layers):
        off = total = 0
        for slot in cache_f.live:
            for a, b in zip(cache_f.gather(layer, slot), cache_r.gather(layer, slot)):  # K, V, positions
                assert a.shape == b.shape
                if layer == 0:
                    assert torch.equal(a, b)
                off += int(((a.float() - b.float()).abs() > 2e-3 + 1e-3 * b.float().abs()).sum())
                total += a.numel()
        assert off <= total // 10_000, (layer, off, total)


def test_not_fused_over_a_codec_cache_the_kernels_do_not_read():
    """fp8 blocks (no "cpu_attention" kernel) and a head dim the codec kernel lacks run op by op."""
    from kvbench.quant.codecs import Fp8Codec

    for model, codec in ((tiny_model(vocab=300, seed=3, **HEAD_DIM_64), Fp8Codec()),
                         (tiny_model("llama", seed=3), KiviCodec(2, group_size=32, residual=32))):
        cfg = model.config
        cache = build_cache(codec=codec, kv_memory_bytes=2**22, num_layers=cfg.num_layers,
                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, block_size=16,
                            dtype=torch.float32, device="cpu")
        slot = cache.add_sequence()
        plan = cache.prepare_append([slot], torch.zeros(1, 1, dtype=torch.int64))
        with torch.inference_mode():
            assert try_fused(CPU, model, torch.zeros(1, 1, dtype=torch.long), cache, plan,
                             *model.rotary.lookup(plan.query_positions), False) is None


@pytest.mark.parametrize("evict", [False, True])
def test_hooks_see_the_same_queries_and_key_scores(evict):
    """A method's hook gets q and the per-key attention mass of every layer as before, also when an earlier step's
    eviction left the heads of a layer with different lengths."""
    model = tiny_model("llama", seed=8)
    prompts = [list(range(5, 45)), list(range(60, 83))]
    hooks = {f: RecordingHook(needs_key_scores=True, evict=evict) for f in (True, False)}
    logits = {f: run(model, prompts, 10, fused=f, hook=hooks[f])[0] for f in (True, False)}
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    seen_f, seen_r = hooks[True].seen, hooks[False].seen
    assert [s[:2] for s in seen_f] == [s[:2] for s in seen_r]
    decode = [(f, r) for f, r in zip(seen_f, seen_r) if f[1] == "decode"]
    assert len(decode) == 10 * model.config.num_layers
    for (_, _, qf, kf), (_, _, qr, kr) in decode:
        assert qf.shape == qr.shape and kf.shape == kr.shape
        torch.testing.assert_close(qf, qr, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kf, kr, atol=1e-6, rtol=1e-5)


class CacheOnlyHook(RecordingHook):
    """A decode hook that reads only the cache (decode_reads_attention = False): evicts as RecordingHook does."""

    decode_reads_attention = False
    acts_after_attention = True


def test_a_cache_only_hook_runs_after_the_one_call_step(monkeypatch):
    """With decode_reads_attention = False the fused step runs every layer in one C call and then calls the hook
    for each layer (ctx.q None): the same logits and cache as the per-layer calls and the op-by-op path."""
    model = tiny_model("llama", seed=8)
    prompts = [list(range(5, 45)), list(range(60, 83))]
    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    after_step = CacheOnlyHook(needs_key_scores=False, evict=True)
    logits, cache = run(model, prompts, 10, fused=True, hook=after_step)
    assert calls == [model.config.num_layers] * 10  # one call of every layer per decode step
    decode = [s for s in after_step.seen if s[1] == "decode"]
    assert [s[0] for s in decode] == list(range(model.config.num_layers)) * 10 and all(s[2] is None for s in decode)
    for fused in (True, False):
        per_layer = RecordingHook(needs_key_scores=False, evict=True)
        ref, ref_cache = run(model, prompts, 10, fused=fused, hook=per_layer)
        for a, b in zip(logits, ref):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
        assert torch.equal(cache.lengths, ref_cache.lengths)
        for slot in cache.live:
            for layer in range(model.config.num_layers):
                for a, b in zip(cache.gather(layer, slot), ref_cache.gather(layer, slot)):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_not_fused_where_it_does_not_apply():
    """Prefill chunks, more sequences than the GEMV takes, the torch attention and pre-RoPE caches run op by op."""
    model = tiny_model("llama", seed=9)
    cfg = model.config
    cache = PagedKVCache(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         block_size=4, num_blocks=200)
    n = cpu_kernels.GEMV_MAX_ROWS + 1
    slots = [cache.add_sequence() for _ in range(n)]
    plan = cache.prepare_append(slots, torch.zeros(n, 1, dtype=torch.int64))
    cos, sin = model.rotary.lookup(plan.query_positions)
    with torch.inference_mode():
        assert try_fused(CPU, model, torch.zeros(n - 1, 1, dtype=torch.long), cache, plan, cos, sin, False) is not None
        assert try_fused(CPU, model, torch.zeros(n, 1, dtype=torch.long), cache, plan, cos, sin, False) is None
        assert try_fused(CPU, model, torch.zeros(1, 2, dtype=torch.long), cache, plan, cos, sin, False) is None
        assert try_fused(TORCH, model, torch.zeros(1, 1, dtype=torch.long), cache, plan, cos, sin, False) is None
        cache.store_pre_rope = True
        assert try_fused(CPU, model, torch.zeros(1, 1, dtype=torch.long), cache, plan, cos, sin, False) is None
    with torch.enable_grad():
        cache.store_pre_rope = False
        assert try_fused(CPU, model, torch.zeros(1, 1, dtype=torch.long), cache, plan, cos, sin, False) is None


@pytest.mark.parametrize("f16c", [True, False])
def test_float_to_half_rounds_as_torch(tmp_path, f16c):
    """The fused write's fp32 -> fp16 conversion (csrc/decode_ops.h: F16C, or the software fallback of a build
    without it) gives torch's bits: normals, ties, subnormals, overflow to inf, inf and nan."""
    src = tmp_path / "to_half.c"
    src.write_text('#include "decode_ops.h"\nvoid to_half(const float *x, uint16_t *y, long n) {\n'
                   '    for (long i = 0; i < n; i++) y[i] = float_to_half(x[i]);\n}\n')
    lib_path = tmp_path / "to_half.so"
    flags = ["-O2", "-march=native", "-mf16c" if f16c else "-mno-f16c", "-shared", "-fPIC"]
    subprocess.run([os.environ.get("CC", "cc"), *flags, f"-I{CSRC}", str(src), "-o", str(lib_path), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = torch.cat([bits.view(torch.float32), torch.randn(1 << 16, generator=gen) * 1e-5,  # fp16 subnormals
                   (torch.arange(1 << 16, dtype=torch.int32) << 13).view(torch.float32),  # every fp16 value
                   ((torch.arange(1 << 16, dtype=torch.int32) << 13) + (1 << 12)).view(torch.float32),  # ties
                   torch.tensor([65504.0, 65520.0, 65519.99, 1e9, -1e9, float("inf"), -float("inf"), 0.0, -0.0,
                                 2.0 ** -25, 2.0 ** -24, 2.0 ** -26])])
    x = torch.where(x.isnan(), torch.full_like(x, float("nan")), x)  # one nan payload: torch keeps its own
    y = torch.empty(x.numel(), dtype=torch.int16)
    lib.to_half(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_long(x.numel()))
    ref = x.to(torch.float16).view(torch.int16)
    finite = ~x.isnan()
    assert torch.equal(y[finite], ref[finite])
    assert y.view(torch.float16)[~finite].isnan().all()


def test_the_phase_clock_times_every_phase_of_fused_steps_only_while_on():
    """bench/profile_decode.py's clock: each phase of the fused layers gets time while it is on (page_select only
    where a method retrieves pages: none here), their sum is within the wall time of the steps, and nothing is added
    once it is off."""
    import time

    model = tiny_model("llama", seed=7)
    prompts = [[(5 * j) % 300 for j in range(30)]]
    with cpu_kernels.PhaseClock() as clock:
        t0 = time.perf_counter()
        run(model, prompts, 6, fused=True)
        wall = time.perf_counter() - t0
    seconds = clock.seconds()
    assert set(seconds) == set(cpu_kernels.DECODE_PHASES)
    assert seconds.pop("page_select") == 0.0
    assert all(s > 0 for s in seconds.values()) and sum(seconds.values()) <= wall
    run(model, prompts, 6, fused=True)
    assert clock.seconds() == {**seconds, "page_select": 0.0}  # off: the kernel no longer writes the accumulators


# --- weights kept quantized (model.weights=quantized): the fused step over a GGUF file's blocks -----------------

# each projection's parts (q/k/v, gate/up stacked as a QuantLinear's parts) in one type, or mixed as Q4_K_M files mix
# them inside q/k/v
QUANT_LAYOUTS = {t: {"qkv": (t, t, t), "o": (t,), "gate_up": (t, t), "down": (t,)}
                 for t in ("Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K")}
QUANT_LAYOUTS["mixed"] = {"qkv": ("Q4_K", "Q6_K", "Q5_0"), "o": ("Q8_0",), "gate_up": ("Q5_K", "Q4_0"),
                          "down": ("Q6_K",)}
QUANT_SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 2, "head_dim": 64, "intermediate": 512, "vocab": 300,
               "max_positions": 2048}  # every input size a multiple of 256 (the K-quants' super-block)


def scaled_quant_matrix(type_name: str, rows: int, cols: int, g: torch.Generator, std: float = 0.05):
    """quant_linear.random_quant_matrix with its fp16 scales (d, and dmin) multiplied so that the values' standard
    deviation is about `std` (every value of these types is linear in them): a model whose activations stay sane."""
    qm = ql.random_quant_matrix(type_name, rows, cols, g)
    c = std / qm.dequantize().std().item()
    blocks = qm.data.view(-1, ql.block_shape(qm.type_id)[1])  # in place
    for off in ql._SCALE_OFFSETS[type_name]:
        d = blocks[:, off: off + 2].contiguous().view(torch.float16).float() * c
        blocks[:, off: off + 2] = d.to(torch.float16).view(torch.uint8).view(-1, 2)
    return qm


def quantized_model(layout: dict, family: str = "llama", seed: int = 5):
    """A tiny model whose projections are QuantLinears of random blocks (layout: the type of each stacked part),
    biases kept (qwen2's q/k/v); the embeddings and head stay fp32."""
    model = tiny_model(family, seed=seed, **QUANT_SHAPE)
    cfg = model.config
    Hq, H, D, E, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    outs = {"qkv": (Hq * D, H * D, H * D), "o": (E,), "gate_up": (I, I), "down": (E,)}
    ins = {"qkv": E, "o": Hq * D, "gate_up": E, "down": I}
    g = torch.Generator().manual_seed(seed)
    for lw in model.layers:
        for name, types in layout.items():
            parts = [scaled_quant_matrix(t, rows, ins[name], g) for t, rows in zip(types, outs[name])]
            setattr(lw, name, QuantLinear(parts, getattr(lw, name).bias))
    return model


def assert_same_decode(fused, ref, rel: float = 1e-4):
    """Greedy tokens equal and logits within `rel` of their largest magnitude, at every step."""
    for a, b in zip(fused, ref):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= rel, err


@pytest.mark.parametrize("layout", list(QUANT_LAYOUTS))
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_fused_decode_over_quantized_weights_matches_the_op_by_op_path(layout, batch):
    """The fused step multiplies a QuantLinear's parts with quant_matmul.c's kernels inside its region (the decode
    GEMV at 1-2 rows, the expanded-tile path at more), as the op-by-op path does: the same greedy tokens, logits and
    cached K/V (up to the last bits of the C silu against torch's)."""
    model = quantized_model(QUANT_LAYOUTS[layout])
    prompts = [[(7 * i + 3 * j) % 300 for j in range(20 + 13 * i)] for i in range(batch)]
    fused, cache_f = run(model, prompts, 8, fused=True)
    ref, cache_r = run(model, prompts, 8, fused=False)
    assert_same_decode(fused, ref)
    assert torch.equal(cache_f.lengths, cache_r.lengths)
    for slot in cache_f.live:
        for layer in range(model.config.num_layers):
            for a, b in zip(cache_f.gather(layer, slot), cache_r.gather(layer, slot)):  # K, V, positions
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_fused_decode_over_quantized_weights_with_biases_a_hook_and_a_codec_cache():
    """qwen2's q/k/v biases, a method's hook (q and per-key attention mass per layer) and a KIVI-2 cache over
    quantized weights: as op by op."""
    model = quantized_model(QUANT_LAYOUTS["mixed"], family="qwen2")
    assert model.layers[0].qkv.bias is not None
    prompts = [list(range(5, 45)), list(range(60, 83))]
    hooks = {f: RecordingHook(needs_key_scores=True, evict=True) for f in (True, False)}
    logits = {f: run(model, prompts, 8, fused=f, hook=hooks[f])[0] for f in (True, False)}
    assert_same_decode(logits[True], logits[False])
    decode = [(f, r) for f, r in zip(hooks[True].seen, hooks[False].seen) if f[1] == "decode"]
    assert len(decode) == 8 * model.config.num_layers
    for (_, _, qf, kf), (_, _, qr, kr) in decode:
        torch.testing.assert_close(qf, qr, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kf, kr, atol=1e-5, rtol=1e-4)
    prompts = [[(11 * i + 5 * j) % 300 for j in range(40 + 37 * i)] for i in range(2)]
    fused, cache_f = run(model, prompts, 40, fused=True, codec="kivi2")
    ref, cache_r = run(model, prompts, 40, fused=False, codec="kivi2")
    assert cache_f.block_counts()["packed"] > 0
    assert_same_decode(fused, ref)


def test_fused_decode_of_a_quantized_gguf_file(tmp_path):
    """A tiny GGUF file loaded with its weights kept quantized (Q8_0) decodes fused, with the op-by-op numbers;
    model.fuse_decode_layers = False still runs it op by op (run() asserts which path runs)."""
    pytest.importorskip("gguf")
    hf = tiny_hf_model("llama", seed=3, vocab=320, qk_scale=3)
    path = write_gguf(hf, tmp_path / "llama.gguf", "llama", quant="Q8_0")
    model = load_model(str(path), cache_dir=tmp_path / "cache", weights="quantized").model
    assert isinstance(model.layers[0].qkv, QuantLinear)
    prompts = [[(7 * i + 3 * j) % 300 for j in range(20 + 13 * i)] for i in range(3)]
    fused, _ = run(model, prompts, 6, fused=True)
    ref, _ = run(model, prompts, 6, fused=False)
    assert_same_decode(fused, ref)


@pytest.mark.parametrize("layout", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "mixed"])
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_decode_with_q8_activations_matches_the_op_by_op_path(layout, batch):
    """With Q8 activations (quantized_weights.set_quant_activations "q8") the fused step and the op-by-op path quantize
    each projection's input the same way (every part but "mixed"'s Q5_K gate, which stays fp32): the same
    greedy tokens and logits; and the logits do differ from the fp32-activation run's (the option takes effect)."""
    model = quantized_model(QUANT_LAYOUTS[layout])
    prompts = [[(7 * i + 3 * j) % 300 for j in range(20 + 13 * i)] for i in range(batch)]
    fp32, _ = run(model, prompts, 6, fused=True)
    assert set_quant_activations(model, "q8") == 4 * model.config.num_layers
    fused, _ = run(model, prompts, 6, fused=True)
    ref, _ = run(model, prompts, 6, fused=False)
    assert_same_decode(fused, ref)
    assert max((a - b).abs().max().item() for a, b in zip(fused, fp32)) > 1e-4
