"""The runtime on a CUDA GPU: correctness against references, then speed (a script, never a test; CI has no GPU).

    python bench/gpu_check.py [--device cuda] [--quick] [--json FILE]

1. Correctness, on the GPU, each against a plain reference on the same GPU:
   - the kvbench forward (Triton paged attention) against transformers: log-probs and greedy tokens of tiny random
     models of every supported family, fp32;
   - every method and codec: greedy tokens with the default backend (Triton on CUDA) against attention_backend=torch
     (the plain-torch reference attention), and the pool empty afterwards;
   - the serving scheduler with a pool too small for the trace (preemption by recompute): every request's tokens
     equal a batch-1 generate of the same prompt.
2. Speed, on a SmolLM2-135M-shaped model with random weights (the packaged weights are too large to travel to the
   GPU machine, and speed does not depend on the weights' values), bf16: prefill 2048, batch-1 decode at contexts
   512 and 4096, batch-16 decode, each against transformers in the same process; then one serving trace at a fixed
   KV pool for full, paged_eviction and KIVI-2; and make bench-sparse's comparison (batch-1 decode at 16,384 and
   32,768 tokens of random K/V, full against quest@512).
Each section prints one JSON line; --json writes them all to one file. The Triton kernels' own tests run on the GPU
with `KVBENCH_TEST_GPU=1 pytest tests/runtime/test_triton_attention.py` (bench/gpu_check.sh runs both).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from computed import require_computed  # noqa: E402  (bench/computed.py: a speed is work done, not a cache hit)

RESULTS: dict[str, dict] = {}
JSON_PATH: list[Path] = []  # --json: rewritten after every section, so a run cut short keeps what it measured


def section(name):
    """Run one section; a failure is recorded (with its traceback) and the next section still runs."""
    def wrap(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                res = fn(*a, **k)
                res["ok"] = res.get("ok", True)
            except Exception as ex:  # noqa: BLE001 - a GPU check reports every failure and goes on
                traceback.print_exc()
                res = {"ok": False, "error": f"{type(ex).__name__}: {ex}"}
            res["seconds"] = round(time.perf_counter() - t0, 1)
            RESULTS[name] = res
            print(json.dumps({name: res}), flush=True)
            for path in JSON_PATH:
                path.write_text(json.dumps(RESULTS, indent=1))
        return run
    return wrap


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- correctness
@section("model_vs_transformers")
def model_vs_transformers(device: str) -> dict:
    from kvbench.runtime.model.families import build_from_transformers
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.scoring import Scorer
    from tests.tiny_models import FAMILIES, tiny_hf_model

    out = {}
    for family in FAMILIES:
        hf = tiny_hf_model(family).to(device)
        model = build_from_transformers(hf, device=device)
        ids = torch.randint(0, hf.config.vocab_size, (512,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            logits = hf(torch.tensor([ids], device=device)).logits[0].float()
        ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
        engine = Engine(model, prefill_chunk_size=128, num_blocks=512)
        got = Scorer(engine).score(ids)
        diff = (got.to(device) - ref).abs().max().item()
        prompt = ids[:40]
        with torch.no_grad():
            ref_tokens = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=48, min_new_tokens=48,
                                     do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        gen = Engine(model, prefill_chunk_size=16, num_blocks=512).generate([prompt], max_new_tokens=48)[0]
        out[family] = {"backend": engine.attention_backend, "max_abs_logprob_diff": diff,
                       "greedy_tokens_equal": gen.token_ids == ref_tokens}
    out["ok"] = all(v["max_abs_logprob_diff"] <= 1e-3 and v["greedy_tokens_equal"] for v in out.values())
    return out


VARIANTS = [  # (method, method options, codec, codec options)
    ("full", {}, None, {}), ("streaming_llm", {}, None, {}), ("h2o", {}, None, {}),
    ("paged_eviction", {}, None, {}), ("snapkv", {}, None, {}), ("key_diff", {}, None, {}),
    ("kvcrush", {}, None, {}), ("full", {}, "kivi", {"bits": 2}), ("full", {}, "kivi", {"bits": 4}),
    ("full", {}, "int8", {}), ("full", {}, "fp8", {}), ("paged_eviction", {}, "kivi", {"bits": 2}),
    ("full", {}, "nvfp4", {}), ("full", {}, "mxfp4", {}), ("paged_eviction", {}, "nvfp4", {}),
    ("full", {}, "kivi", {"bits": 2, "rotate": "hadamard"}),  # FP4 and rotated rows: the Triton dequantizer
]


def tiny_llama(device, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.runtime.model.families import build_from_transformers

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                      intermediate_size=256, vocab_size=256, max_position_embeddings=1024)
    return build_from_transformers(LlamaForCausalLM(cfg).eval(), device=device)


@section("methods_fast_vs_torch_attention")
def methods_fast_vs_torch(device: str) -> dict:
    from kvbench.methods import build_method
    from kvbench.quant.registry import build_codec
    from kvbench.runtime.serving.engine import Engine

    model = tiny_llama(device)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (150, 97, 210)]
    out = {}
    for name, mopts, codec_name, copts in VARIANTS:
        label = name + (f"+{codec_name}{copts.get('bits', '')}" if codec_name else "") + \
            ("_hadamard" if copts.get("rotate") == "hadamard" else "")
        tokens, backends = {}, {}
        for backend in ("auto", "torch"):
            method = build_method(name, None if name == "full" else 64, **mopts)
            codec = build_codec(codec_name, model, group_size=16, residual=32, **copts) if codec_name == "kivi" \
                else (build_codec(codec_name, model, **copts) if codec_name else None)
            engine = Engine(model, method, codec=codec, block_size=16, num_blocks=1024, prefill_chunk_size=64,
                            attention_backend=backend)
            gens = engine.generate(prompts, max_new_tokens=40)
            tokens[backend] = [x.token_ids for x in gens]
            backends[backend] = engine.attention_backend
            assert engine.cache.pool.in_use == 0, f"{label}: blocks left in the pool"
        same = sum(a == b for a, b in zip(tokens["auto"], tokens["torch"]))
        out[label] = {"backend": backends["auto"], "sequences_equal": f"{same}/{len(prompts)}"}
    out["ok"] = all(v["sequences_equal"].split("/")[0] == v["sequences_equal"].split("/")[1] for v in out.values())
    return out


@section("scheduler_preemption_equals_batch1")
def scheduler_preemption(device: str) -> dict:
    from kvbench.runtime.serving.engine import Engine
    from kvbench.runtime.serving.requests import Request

    model = tiny_llama(device, seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(20, 120, (12,), generator=g)]
    ref = [Engine(model, block_size=8, num_blocks=256).generate([p], max_new_tokens=60)[0].token_ids for p in prompts]
    # 2 layers x 2 kv-heads = 4 tables per sequence; 300 blocks of 8 hold about 3 of the longest (180 tokens)
    engine = Engine(model, block_size=8, num_blocks=300, prefill_chunk_size=32)
    outcome = engine.serve([Request(p, 60) for p in prompts])
    equal = sum(r.output == b for r, b in zip(outcome.requests, ref))
    return {"ok": equal == len(prompts) and outcome.preemptions > 0 and engine.cache.pool.in_use == 0,
            "equal": f"{equal}/{len(prompts)}", "preemptions": outcome.preemptions,
            "max_running": outcome.max_running, "backend": engine.attention_backend}


# ---------------------------------------------------------------------------------------------- speed
def smollm2_shaped(device: str, dtype: torch.dtype):
    """SmolLM2-135M's architecture (30 layers, 9 heads, 3 kv-heads, head_dim 64), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.runtime.model.families import build_from_transformers

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    hf = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    return hf, build_from_transformers(hf, dtype=dtype, device=device)


def timed(fn, device, repeats=3):
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@section("speed_vs_transformers")
def speed(device: str, quick: bool) -> dict:
    from kvbench.runtime.serving.engine import Engine

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    hf, model = smollm2_shaped(device, dtype)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    new = 16 if quick else 64
    res = {"dtype": str(dtype), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}

    def hf_generate(prompts, n):
        ids = torch.tensor(prompts, device=device)
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    def kv_generate(engine, prompts, n):
        gens = engine.generate(prompts, max_new_tokens=n)
        require_computed(sum(g.prefill_tokens for g in gens), sum(map(len, prompts)), "speed_vs_transformers")

    # prefix caching off: each timed repeat of a prompt computes it (bench/computed.py refuses a cache hit)
    engine = Engine(model, kv_memory_bytes=2 * 2**30, prefill_chunk_size=2048, prefix_caching=False)
    res["attention_backend"] = engine.attention_backend
    # prefill 2048 tokens (one new token: the time of the prefill and one sampling)
    p = rand(2048)
    kv_generate(engine, [p], 1), hf_generate([p], 1)  # warm-up (Triton compiles, cuBLAS picks kernels)
    t_kv, t_hf = timed(lambda: kv_generate(engine, [p], 1), device), timed(lambda: hf_generate([p], 1), device)
    res["prefill_tokens_per_s"] = 2048 / t_kv
    res["prefill_tokens_per_s_hf"] = 2048 / t_hf
    # batch-1 decode at 512 and 4096: (time for 1 + new tokens - time for 1) / new
    for ctx in ((512,) if quick else (512, 4096)):
        p = rand(ctx)
        for fn in (lambda: kv_generate(engine, [p], new + 1), lambda: hf_generate([p], new + 1)):
            fn()  # warm-up at this shape
        base_kv, base_hf = timed(lambda: kv_generate(engine, [p], 1), device), timed(lambda: hf_generate([p], 1), device)
        t_kv = timed(lambda: kv_generate(engine, [p], new + 1), device) - base_kv
        t_hf = timed(lambda: hf_generate([p], new + 1), device) - base_hf
        res[f"decode_tokens_per_s_ctx{ctx}"] = new / t_kv
        res[f"decode_tokens_per_s_ctx{ctx}_hf"] = new / t_hf
        res[f"decode_ratio_ctx{ctx}"] = t_hf / t_kv
    # batch 16 (same-length prompts so transformers needs no padding), 16 x 512 + new tokens
    ps = [rand(512) for _ in range(16)]
    kv_generate(engine, ps, 2), hf_generate(ps, 2)
    t_kv = timed(lambda: kv_generate(engine, ps, new), device, repeats=1)
    t_hf = timed(lambda: hf_generate(ps, new), device, repeats=1)
    res["batch16_tokens_per_s"] = 16 * new / t_kv
    res["batch16_tokens_per_s_hf"] = 16 * new / t_hf
    res["batch16_ratio"] = t_hf / t_kv
    assert engine.cache.pool.in_use == 0
    return res


@section("sparse_decode")
def sparse_decode(device: str, quick: bool) -> dict:
    """make bench-sparse on the GPU: batch-1 decode of a SmolLM2-shaped model (bf16) over caches of random K/V, full
    attention against quest@512 (selection in torch on the device, the Triton kernel given the compacted tables),
    runs alternated; tok/s, the ratio and the K/V bytes each read per token."""
    from bench_sparse import decode_run, fill  # noqa: E402  (bench/, this script's folder)

    from kvbench.methods import build_method
    from kvbench.runtime.serving.engine import Engine

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    _, model = smollm2_shaped(device, dtype)
    cfg = model.config
    per_token = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * torch.finfo(dtype).bits // 8
    res: dict = {"dtype": str(dtype), "budget": 512}
    ok = True
    for T in ((1024,) if quick else (16384, 32768)):
        kv_memory = int(per_token * (T + 1024) * 1.3) + (1 << 24)
        engines = {"full": Engine(model, kv_memory_bytes=kv_memory, prefix_caching=False),
                   "quest512": Engine(model, build_method("quest", 512), kv_memory_bytes=kv_memory,
                                      prefix_caching=False)}
        slots = {name: fill(e, T, 0) for name, e in engines.items()}
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(3):
            for name, e in engines.items():
                runs[name].append(decode_run(e, slots[name], 8 if quick else 64, cfg.vocab_size))
        for name, rs in runs.items():
            med = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
            res[f"{name}_tokens_per_s_ctx{T}"] = med["tokens_per_s"]
            res[f"{name}_kv_read_bytes_per_token_ctx{T}"] = med["kv_read_bytes_per_token"]
        res[f"quest512_over_full_ctx{T}"] = res[f"quest512_tokens_per_s_ctx{T}"] / res[f"full_tokens_per_s_ctx{T}"]
        res["attention_backend"] = engines["quest512"].attention_backend
        ok = ok and res[f"quest512_kv_read_bytes_per_token_ctx{T}"] < res[f"full_kv_read_bytes_per_token_ctx{T}"]
        for name, e in engines.items():
            e.end_sequence(slots[name])
            ok = ok and e.cache.pool.in_use == 0
        del engines
        if device == "cuda":
            torch.cuda.empty_cache()
    res["ok"] = ok  # quest read fewer K/V bytes than full, and both pools emptied
    return res


def serving_setup(device: str, num_requests: int, output_tokens: list[int]):
    """The serving scenario: a SmolLM2-shaped model, bench-throughput's engine settings with a pool of four 4096-token
    requests under `full`, and a seeded trace of random-token prompts of 1024-2048 tokens."""
    from kvbench.tasks.throughput import ThroughputOptions, build_trace

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    _, model = smollm2_shaped(device, dtype)
    cfg = model.config
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
    args = argparse.Namespace(block_size=16, kv_memory_bytes=4 * 4096 * bytes_per_token, chunk=512,
                              max_num_seqs=256, max_num_batched_tokens=2048, schedule="mixed", prefix_caching="auto")
    stream = torch.randint(100, cfg.vocab_size - 100, (200_000,), generator=torch.Generator().manual_seed(0)).tolist()
    opts = ThroughputOptions(num_requests=num_requests, input_tokens=[1024, 2048], output_tokens=output_tokens,
                             request_rate=math.inf)
    return model, args, build_trace(stream, opts, 0)


@section("serving_fixed_pool")
def serving(device: str, quick: bool, methods: list[str]) -> dict:
    from bench.bench_throughput import SETUPS, serve

    n_req, out_tokens = (8, [64]) if quick else (16, [512])
    model, args, trace = serving_setup(device, n_req, out_tokens)
    res = {"requests": n_req, "input_tokens": [1024, 2048], "output_tokens": out_tokens, "budget": 1024,
           "kv_pool_bytes": args.kv_memory_bytes}
    others = [m for m in methods if m != "full"]
    for name in ["full"] + others:
        m = serve(model, trace, SETUPS[name], 1024, args)
        res[name] = {k: m[k] for k in ("output_tokens_per_s", "max_running_seqs", "preemptions", "ttft_s_p50",
                                       "peak_kv_bytes", "attention_backend")}
    for name in others:
        res[name]["throughput_ratio_vs_full"] = res[name]["output_tokens_per_s"] / res["full"]["output_tokens_per_s"]
    return res


# ---------------------------------------------------------------------------------------------- Llama-3.1-8B shape
LLAMA8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
# the same structure, small: a dry run of the section on a CPU (--quick)
LLAMA8B_QUICK = dict(LLAMA8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=1024, max_position_embeddings=8192)


def llama8b_shaped(device: str, quick: bool):
    """A Llama-3.1-8B-shaped model (random bf16 weights, created on the device), transformers' and kvbench's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.runtime.model.families import build_from_transformers

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    cfg = LlamaConfig(**(LLAMA8B_QUICK if quick else LLAMA8B))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    return hf, build_from_transformers(hf, dtype=dtype, device=device)


def copy_bandwidth(device: str) -> float:
    """Measured device copy bandwidth, bytes read + written per second (1 GiB copied, median of 5)."""
    src = torch.empty(2**30 // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.nbytes / timed(lambda: dst.copy_(src), device, repeats=5)


def decode_kernel_bandwidth(device: str, batch: int, ctx: int, *, kv_heads=8, group=4, head_dim=128,
                            block_size=16, iters=20) -> dict:
    """The split-KV decode kernel alone on one layer's pool: K/V bytes read per second (each table ctx tokens)."""
    from kvbench.runtime.backends.triton.decode import default_num_splits, paged_decode_triton

    nb = ctx // block_size
    n_blocks = batch * kv_heads * nb + 1
    k = torch.randn(n_blocks, block_size, head_dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    tables = (torch.randperm(n_blocks - 1, device=device)[: batch * kv_heads * nb] + 1).to(torch.int32)
    tables = tables.view(batch, kv_heads, nb)
    lengths = torch.full((batch, kv_heads), ctx, dtype=torch.int64, device=device)
    q = torch.randn(batch, kv_heads * group, 1, head_dim, dtype=torch.bfloat16, device=device)
    run = lambda: paged_decode_triton(q, k, v, tables, lengths, head_dim ** -0.5)  # noqa: E731
    run()
    t = timed(lambda: [run() for _ in range(iters)], device) / iters
    kv_bytes = 2 * batch * kv_heads * ctx * head_dim * 2
    return {"batch": batch, "ctx": ctx, "splits": default_num_splits(torch.device(device), batch, kv_heads,
                                                                       nb * block_size),
            "us": t * 1e6, "kv_GB_per_s": kv_bytes / t / 1e9}


def step_times(engine, prompt: list[int], steps: int, device: str) -> float:
    """Seconds per decode step of one sequence after `prompt` (wall time, the step's one sync included)."""
    slot = engine.new_sequence()
    tok = int(engine.forward_chunk(slot, prompt, 0)[0].argmax())
    pos = len(prompt)
    for _ in range(3):  # warm-up (captures, compiles)
        tok = engine.decode_batch([slot], [tok], [pos])[0]
        pos += 1
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        tok = engine.decode_batch([slot], [tok], [pos])[0]
        pos += 1
    sync(device)
    out = (time.perf_counter() - t) / steps
    engine.end_sequence(slot)
    return out


@section("llama8b_shaped")
def llama8b(device: str, quick: bool, serving_methods: list[str], serving_budget_s: float) -> dict:
    """Llama-3.1-8B-shaped, random bf16 weights, beside transformers on the same GPU: batch-1 decode, the decode
    kernel's bandwidth, host time per step, the serving trace at a fixed pool."""
    from bench.bench_throughput import SETUPS, serve
    from kvbench.runtime.serving.engine import Engine
    from kvbench.tasks.throughput import ThroughputOptions, build_trace

    on_cuda = torch.device(device).type == "cuda"
    hf, model = llama8b_shaped(device, quick)
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * elem
    res = {"dtype": str(model.dtype), "weight_bytes": model.weight_bytes, "kv_bytes_per_token": kv_per_token}
    bw = copy_bandwidth(device) if on_cuda else None
    res["copy_GB_per_s"] = bw / 1e9 if bw else None
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(100, cfg.vocab_size - 100, (n,), generator=g).tolist()  # noqa: E731
    new = 8 if quick else 32
    contexts = (256, 1024) if quick else (4096, 32768)

    # batch-1 decode, kvbench (graphs on CUDA) vs transformers, and the fraction of copy bandwidth it reaches
    engine = Engine(model, kv_memory_bytes=(max(contexts) + 256) * kv_per_token * 2, prefill_chunk_size=4096)
    res["attention_backend"] = engine.attention_backend
    res["cuda_graphs"] = engine.decode_graphs is not None
    for ctx in contexts:
        p = rand(ctx)
        t_step = step_times(engine, p, new, device)
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            base = timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False,
                                             pad_token_id=0), device, repeats=1)
            full = timed(lambda: hf.generate(ids, max_new_tokens=new + 1, min_new_tokens=new + 1, do_sample=False,
                                             pad_token_id=0), device, repeats=1)
        t_hf = (full - base) / new
        read = model.weight_bytes + ctx * kv_per_token  # bytes one decode step must read
        res[f"decode_tok_s_ctx{ctx}"] = 1 / t_step
        res[f"decode_tok_s_ctx{ctx}_hf"] = 1 / t_hf
        res[f"decode_ratio_vs_hf_ctx{ctx}"] = t_hf / t_step
        # a step reads `read` bytes; a copy moves bw bytes/s (read + write): the bound is 2 * read / bw per step
        res[f"decode_fraction_of_copy_bw_ctx{ctx}"] = (2 * read / bw) / t_step if bw else None
    del hf
    if on_cuda:
        torch.cuda.empty_cache()
        res["kernel_b1_ctx32768"] = decode_kernel_bandwidth(device, 1, 32768 if not quick else 1024)
        res["kernel_b32_ctx4096"] = decode_kernel_bandwidth(device, 32, 4096 if not quick else 512)
        for key in ("kernel_b1_ctx32768", "kernel_b32_ctx4096"):
            res[key]["fraction_of_copy_bw"] = 2 * res[key]["kv_GB_per_s"] * 1e9 / bw

    # host time per step, eager and with graphs: wall per step minus the GPU's time for the same step (a replay)
    p = rand(contexts[0])
    eager = Engine(model, kv_memory_bytes=(contexts[0] + 256) * kv_per_token * 2, cuda_graphs=False)
    res["step_ms_eager"] = step_times(eager, p, new, device) * 1e3
    if on_cuda:
        graphed = Engine(model, kv_memory_bytes=(contexts[0] + 256) * kv_per_token * 2, cuda_graphs=True)
        res["step_ms_graphs"] = step_times(graphed, p, new, device) * 1e3
        gpu_ms = graph_replay_ms(graphed)
        res["step_gpu_ms"] = gpu_ms
        res["host_ms_per_step_eager"] = max(0.0, res["step_ms_eager"] - gpu_ms)
        res["host_ms_per_step_graphs"] = max(0.0, res["step_ms_graphs"] - gpu_ms)
        del graphed
    del eager, engine

    # the serving trace at a fixed pool: 16 x 4096-token prompts, 1024 output tokens, pool = 4 full prompts
    n_req, inp, out_tok = (4, 256, 32) if quick else (16, 4096, 1024)
    stream = torch.randint(100, cfg.vocab_size - 100, (200_000,), generator=torch.Generator().manual_seed(0)).tolist()
    trace = build_trace(stream, ThroughputOptions(num_requests=n_req, input_tokens=[inp], output_tokens=[out_tok],
                                                  request_rate=math.inf), 0)
    args = argparse.Namespace(block_size=16, kv_memory_bytes=4 * inp * kv_per_token, chunk=2048, max_num_seqs=256,
                              max_num_batched_tokens=8192, schedule="mixed", prefix_caching="auto")
    budget = 1024 if not quick else 64
    srv = {"requests": n_req, "input_tokens": inp, "output_tokens": out_tok, "budget": budget,
           "kv_pool_bytes": args.kv_memory_bytes}
    t_start = time.perf_counter()
    for name in serving_methods:
        if time.perf_counter() - t_start > serving_budget_s:
            srv[name] = {"skipped": f"serving time budget ({serving_budget_s:.0f} s) spent"}
            continue
        m = serve(model, trace, SETUPS[name], budget, args)
        srv[name] = {k: m[k] for k in ("output_tokens_per_s", "max_running_seqs", "preemptions", "wall_s",
                                       "peak_kv_bytes")}
    full = srv.get("full", {}).get("output_tokens_per_s")
    for name in serving_methods:
        if name != "full" and full and "output_tokens_per_s" in srv[name]:
            srv[name]["throughput_ratio_vs_full"] = srv[name]["output_tokens_per_s"] / full
    res["serving"] = srv
    return res


def graph_replay_ms(engine) -> float:
    """GPU milliseconds of one replay of the engine's batch-1 decode graph (CUDA events, median of 20)."""
    graphs = engine.decode_graphs
    g = next(g for (b, _), g in graphs.graphs.items() if b == 1)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def profile_serving(device: str, out_dir: Path) -> None:
    """cProfile of a short serving trace per method (where a step's host time goes): out_dir/profile_<method>.txt."""
    import cProfile
    import io
    import pstats

    from bench.bench_throughput import SETUPS, serve

    model, args, trace = serving_setup(device, 8, [128])
    serve(model, trace, SETUPS["full"], 1024, args)  # warm-up
    for name in ("full", "paged_eviction"):
        prof = cProfile.Profile()
        prof.enable()
        m = serve(model, trace, SETUPS[name], 1024, args)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        (out_dir / f"profile_{name}.txt").write_text(buf.getvalue())
        print(f"profile {name}: {m['output_tokens_per_s']:.1f} out tok/s; top functions by own time:")
        print("\n".join(buf.getvalue().splitlines()[:28]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a dry run on a CPU)")
    ap.add_argument("--json", default=None, help="write every section's result to this file")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also profile a short serving trace into DIR")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: model,methods,preemption,speed,"
                                                "sparse,serving,llama8b")
    ap.add_argument("--serving-methods", default="full,paged_eviction,kivi2")
    ap.add_argument("--llama8b-serving-methods",
                    default="full,paged_eviction,streaming_llm,kivi2,paged_eviction+kivi2,snapkv,h2o")
    ap.add_argument("--llama8b-serving-budget-s", type=float, default=150.0,
                    help="stop starting new serving runs of the 8B section after this many seconds")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (use --device cpu --quick for a dry run)")
    skip = set(args.skip.split(","))
    if args.json:
        JSON_PATH.append(Path(args.json))
    print(f"gpu_check: torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""), flush=True)
    if "model" not in skip:
        model_vs_transformers(args.device)
    if "methods" not in skip:
        methods_fast_vs_torch(args.device)
    if "preemption" not in skip:
        scheduler_preemption(args.device)
    if "speed" not in skip:
        speed(args.device, args.quick)
    if "sparse" not in skip:
        sparse_decode(args.device, args.quick)
    if "serving" not in skip:
        serving(args.device, args.quick, args.serving_methods.split(","))
    if "llama8b" not in skip:
        llama8b(args.device, args.quick, args.llama8b_serving_methods.split(","), args.llama8b_serving_budget_s)
    if args.profile:
        profile_serving(args.device, Path(args.profile))
    print("gpu_check: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'}" for k, v in RESULTS.items()))
    print(json.dumps({"gpu_check": RESULTS}), flush=True)  # everything in one JSON line


if __name__ == "__main__":
    main()
