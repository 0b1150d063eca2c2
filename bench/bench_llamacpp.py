"""kvbench against llama.cpp on the same GGUF file: prefill and decode tok/s per weights type, same threads, alternated.

The weights axis (`--weights f32,q8_0,q4_k_m`, all three by default): the packaged SmolLM2-135M Q4_1 GGUF is
converted once to F32 by llama.cpp's own llama_model_quantize (ftype ALL_F32), and the F32 copy once to Q8_0 and
Q4_K_M (ftypes MOSTLY_Q8_0, MOSTLY_Q4_K_M), cached in $KVBENCH_CACHE_DIR/llamacpp. Both sides then load the same
file: llama.cpp through llama_model_load_from_file, kvbench through its GGUF path with model.weights=quantized (the
blocks multiplied in place by backends/cpu/quant_linear.py; a tensor whose block type has no kernel is read
de-quantized to fp32, and the bench prints, per file, its 2-D tensors by type and how many of the model's
projections are held quantized or fp32). SmolLM2's rows of 576 are no multiple of 256, so llama.cpp writes the
Q4_K_M file's K-quant tensors of that width in its fallback types (Q4_K -> Q5_0, Q6_K -> Q8_0): the file holds
Q4_K, Q5_0, Q6_K and Q8_0 blocks, all of which kvbench has kernels for.

Shapes, per weights type: prefill of --prefill-tokens (2,048) tokens of one sequence (kvbench in one chunk;
llama.cpp in one llama_decode call, n_batch 2,048 / n_ubatch 512 as llama-bench's defaults, logits of the last
token only, after an untimed prefill of the same tokens and a cleared KV cache), batch-1 decode at each --contexts
(512, 4,096, 16,384) and batch-16 decode at --batch16-context (512): per shape kvbench tok/s, llama.cpp tok/s,
their ratio and kvbench's fraction of the memory-bandwidth limit.

llama.cpp comes from the `llama_cpp` Python bindings (llama-cpp-python from PyPI, built from its sdist) of the
interpreter given with --llamacpp-python; it runs in a child process of that interpreter (this file in worker mode,
which imports only llama_cpp), through the low-level API: a prefill of the context with llama_decode, then timed
llama_decode calls of one token per sequence (batch 1 at each context; 16 sequences in one llama_batch for batch
16), flash attention off and on, the faster reported. llama.cpp's side feeds a fixed next token (no sampling);
kvbench's decode steps include its greedy sampling. llama.cpp's K/V cache is F16 (its default), kvbench's fp32 (the
model's dtype): at long contexts kvbench reads twice llama.cpp's K/V bytes a step.

Both sides are timed warm. llama.cpp clears its whole KV buffer when its context is created, before any timed
step, and its first decode step (graph set-up for one-token batches) is run untimed. kvbench's pool is virtual
until written (runtime.kv_memory_bytes, 4 GiB by default), so a run's first pass through fresh blocks pays the
kernel's page faults: on the 2-core dev VM, batch 16's tables took their new blocks in 27-30 ms at each block
boundary on fresh pages, against 3-4 ms on pages written before. Each shape therefore gets one untimed kvbench run
of the same prompts and length first (as a server's pool is warm after its first requests), then the timed runs.

Without --llamacpp-python (and without llama_cpp in this interpreter: the `llamacpp` extra) the script prints one
line saying it is skipped and how to enable it (CI never needs it):

    python3 -m venv /tmp/llamacpp_env && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp_env/bin/pip install \\
        llama-cpp-python==0.3.36
    python bench/bench_llamacpp.py --llamacpp-python /tmp/llamacpp_env/bin/python [--weights q8_0,q4_k_m] \\
        [--contexts 512,4096,16384] [--prefill-tokens 2048] [--load]

kvbench's fraction of the memory-bandwidth limit, per shape: the bytes one step must read (the weights as loaded,
model.weight_bytes: the quantized blocks' real byte size for kept matrices, 4 bytes a weight for fp32 ones; plus
the K/V of each sequence's context and half the new tokens for decode, and the prompt's K/V written for prefill)
x steps/s, over the best copy bandwidth (read + write of a large tensor) measured before and after each kvbench
run. Prefill is bound by arithmetic, not memory: its fraction is small by nature. `--load` runs everything beside
one competing CPU-bound process (as on a shared node).

Verdicts (`target_checks`): issue 47's on the F32 weights (batch 16 at least 6x batch 1 at context 512, batch 1 at
context 4,096 at >= 0.85 of copy bandwidth) and issue 66's kvbench ahead of llama.cpp at every shape measured, per
weights type (`ahead_of_llamacpp_<weights>_<shape>`); a shape that falls short, or whose llama.cpp run failed,
prints MISS and false.

The last line is one JSON object: per weights type and shape (keys `<figure>_<weights>_<shape>`, shape `prefill2048`,
`b1_ctx512`, ..., `b16_ctx512`) kvbench and llama.cpp tok/s and their ratio, kvbench's bandwidth fraction, batch 16
over batch 1, per weights type the file's tensor types and kvbench's weight bytes (`weights`), and the verdicts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

WORKER = "--llamacpp-worker"
MAKE_GGUF = "--llamacpp-make-gguf"
# weights type -> llama.cpp's llama_ftype name (llama_model_quantize's target), in the order the bench runs them
WEIGHT_TYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


# ---------------------------------------------------------------------------------- llama.cpp worker (child)
def _llama_cpp():
    """The bindings, initialised, with llama.cpp's log silenced (the callback kept referenced)."""
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    L._kvbench_quiet = L.llama_log_callback(lambda *a: None)
    L.llama_log_set(L._kvbench_quiet, ctypes.c_void_p(0))
    return L


def make_gguf(args) -> None:
    """Child mode: llama_model_quantize --src into --dest with --ftype (written to a temporary name, then renamed)."""
    import ctypes

    L = _llama_cpp()
    qp = L.llama_model_quantize_default_params()
    qp.ftype = getattr(L, args.ftype)
    qp.nthread = args.threads
    qp.allow_requantize = True  # the packaged GGUF is Q4_1 (its token embedding Q8_0): de-quantized to F32 first
    tmp = args.dest + ".tmp"
    if L.llama_model_quantize(args.src.encode(), tmp.encode(), ctypes.byref(qp)) != 0:
        raise SystemExit(f"llama_model_quantize of {args.src} to {args.ftype} failed")
    os.replace(tmp, args.dest)


def worker(args) -> None:
    """Child mode, run by the llama-cpp-python interpreter: tok/s of one shape of --model, printed as JSON. --prefill
    N: one sequence's N-token prompt in one llama_decode call (after an untimed one and a cleared cache); else decode
    of --batch sequences at context --ctx."""
    import random

    L = _llama_cpp()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama_model_load_from_file({args.model}) failed")
    S, ctx_len, n = args.batch, args.ctx, args.decode_tokens
    cp = L.llama_context_default_params()
    if args.prefill:
        S, cp.n_ctx, cp.n_batch, cp.n_ubatch = 1, args.prefill + 16, args.prefill, 512
    else:
        cp.n_ctx = S * (ctx_len + n + 9)
        cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = S
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    batch = L.llama_batch_init(max(512, args.prefill), 0, S)

    def decode(items: list[tuple[int, int, int]], logits: str) -> None:  # (token, pos, seq); logits all|last|none
        batch.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits == "all" or (logits == "last" and i == len(items) - 1)
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    rng = random.Random(ctx_len if not args.prefill else args.prefill)
    if args.prefill:
        toks = [rng.randrange(100, n_vocab - 100) for _ in range(args.prefill)]
        items = [(t, i, 0) for i, t in enumerate(toks)]
        decode(items, "last")  # untimed: buffers, graph, the weights' pages
        if hasattr(L, "llama_memory_clear"):  # the whole cache (the untimed prompt's K/V) dropped
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
        else:  # bindings before llama.cpp's memory API
            L.llama_kv_self_clear(ctx)
        t = time.perf_counter()
        decode(items, "last")
        tps = args.prefill / (time.perf_counter() - t)
    else:
        for s in range(S):  # prefill, 512 tokens per call
            toks = [rng.randrange(100, n_vocab - 100) for _ in range(ctx_len)]
            for a in range(0, ctx_len, 512):
                decode([(t, a + i, s) for i, t in enumerate(toks[a:a + 512])], "none")
        decode([(999, ctx_len, s) for s in range(S)], "all")  # untimed: the first one-token step sets up its graph
        times = []
        for step in range(n):
            t = time.perf_counter()
            decode([(1000 + step, ctx_len + 1 + step, s) for s in range(S)], "all")
            times.append(time.perf_counter() - t)
        tps = S * len(times) / sum(times)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"tokens_per_s": tps}))


def _child(args, extra: list[str], what: str, timeout: int = 3600) -> str | None:
    """Run this file in a child mode under --llamacpp-python; its last stdout line, or None (the failure printed)."""
    cmd = [args.llamacpp_python, os.path.abspath(__file__), *extra, "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or (not lines and extra[0] == WORKER):
        print(f"llama.cpp {what} failed: {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return None
    return lines[-1] if lines else ""


def run_llamacpp(args, model: str, ctx: int, batch: int, flash: bool, prefill: int = 0) -> float | None:
    extra = [WORKER, "--model", model, "--ctx", str(ctx), "--batch", str(batch), "--decode-tokens",
             str(args.decode_tokens), "--prefill", str(prefill)] + (["--flash"] if flash else [])
    line = _child(args, extra, f"run ({os.path.basename(model)}, {shape_key(ctx, batch, prefill)}, flash {flash})")
    try:
        return json.loads(line)["tokens_per_s"] if line else None
    except (ValueError, KeyError):
        print(f"llama.cpp printed no figure: {line[-400:]}", file=sys.stderr)
        return None


def gguf_files(args, packaged: str, cache: str, weights: list[str]) -> dict[str, str]:
    """weights type -> the GGUF file both sides load: made once by llama.cpp's llama_model_quantize (F32 from the
    packaged Q4_1 file, the others from the F32 copy) and kept in `cache`."""
    os.makedirs(cache, exist_ok=True)
    stem = os.path.basename(packaged).rsplit(".", 2)[0]  # SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct
    files = {w: os.path.join(cache, f"{stem}.{w.upper()}.gguf") for w in WEIGHT_TYPES}
    for w in ["f32"] + [w for w in weights if w != "f32"]:
        if os.path.exists(files[w]):
            continue
        src = packaged if w == "f32" else files["f32"]
        print(f"making {os.path.basename(files[w])} with llama_model_quantize (once)", file=sys.stderr)
        if _child(args, [MAKE_GGUF, "--src", src, "--dest", files[w], "--ftype", WEIGHT_TYPES[w]],
                  f"llama_model_quantize to {w}") is None or not os.path.exists(files[w]):
            raise SystemExit(f"could not make the {w} GGUF file {files[w]}")
    return {w: files[w] for w in weights}


# ---------------------------------------------------------------------------------- kvbench side
def shape_key(ctx: int, batch: int, prefill: int = 0) -> str:
    """The JSON key of a shape: prefill2048, b1_ctx512, b16_ctx512."""
    return f"prefill{prefill}" if prefill else f"b{batch}_ctx{ctx}"


def kvbench_decode(engine, ctx: int, batch: int, n: int, vocab: int, warm_up: bool = False) -> tuple[float, float]:
    """(decode tok/s, best copy bandwidth in bytes/s measured right before and after the run). warm_up: one untimed
    run of the same prompts first (the pool's fresh pages faulted in; see the module docstring)."""
    import torch
    from bench_runtime import measure_copy_bandwidth

    g = torch.Generator().manual_seed(ctx)
    prompts = [torch.randint(100, vocab - 100, (ctx,), generator=g).tolist() for _ in range(batch)]
    if warm_up:
        engine.generate(prompts, max_new_tokens=n + 1)
    before = measure_copy_bandwidth()
    gens = engine.generate(prompts, max_new_tokens=n + 1)
    bw = max(before, measure_copy_bandwidth())
    return sum(x.decode_tokens for x in gens) / max(x.decode_s for x in gens), bw


def kvbench_prefill(engine, n: int, vocab: int, warm_up: bool = False) -> tuple[float, float]:
    """(prefill tok/s of one n-token prompt in one chunk, best copy bandwidth before and after); warm_up as above.
    Prefix caching is off in the bench's engine, and bench_runtime.kv_prefill_tps refuses a prompt a cache served."""
    from bench_runtime import kv_prefill_tps, measure_copy_bandwidth, random_prompt

    ids = random_prompt(n, vocab, n)
    if warm_up:
        kv_prefill_tps(engine, ids)
    before = measure_copy_bandwidth()
    tps = kv_prefill_tps(engine, ids)
    return tps, max(before, measure_copy_bandwidth())


def step_bytes(weight_bytes: int, kv_bytes_per_token: int, ctx: int, batch: int, decode_tokens: int,
               prefill: int = 0) -> int:
    """Bytes one step must read: the weights, plus each sequence's K/V (its context and half the new tokens) for a
    decode step, or the prompt's K/V (written) for a prefill of `prefill` tokens in one pass."""
    if prefill:
        return weight_bytes + prefill * kv_bytes_per_token
    return weight_bytes + batch * (ctx + decode_tokens // 2) * kv_bytes_per_token


def weights_census(path: str, model) -> dict:
    """What kvbench holds of a GGUF file: its 2-D tensors by block type (and how many of those types have no kernel,
    i.e. are read de-quantized to fp32), the model's projections held quantized / in fp32, and its weight bytes."""
    import gguf
    from kvbench.runtime.backends.cpu.quant_linear import QUANT_TYPES, QuantLinear

    types: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) == 2:
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    lins = [lin for lw in model.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [model.lm_head]
    quantized = sum(isinstance(lin, QuantLinear) for lin in lins)
    return {"tensor_types": types, "tensors_without_kernel": sum(n for t, n in types.items() if t not in QUANT_TYPES),
            "projections_quantized": quantized, "projections_fp32": len(lins) - quantized,
            "weight_bytes": model.weight_bytes}


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x)


def target_checks(res: dict, contexts: list[int], batch16_context: int = 512, weights: tuple = ("f32",),
                  prefill_tokens: int = 0) -> dict[str, bool]:
    """The targets from the bench's figures: name -> met. Issue 47's on the F32 weights (when measured), issue 66's
    per weights type and shape (kvbench ahead of llama.cpp). A missing, None or NaN figure is not met."""
    checks = {}
    if "f32" in weights:
        b1, b16 = res.get(f"kvbench_f32_b1_ctx{batch16_context}"), res.get(f"kvbench_f32_b16_ctx{batch16_context}")
        ratio = b16 / b1 if _ok(b1) and _ok(b16) and b1 > 0 else None
        frac = res.get("bandwidth_fraction_f32_b1_ctx4096")
        checks[f"b16_over_b1_ctx{batch16_context}_ge_6"] = _ok(ratio) and ratio >= 6.0
        checks["bandwidth_fraction_b1_ctx4096_ge_0.85"] = _ok(frac) and frac >= 0.85
    shapes = ([shape_key(0, 1, prefill_tokens)] if prefill_tokens else []) + \
        [shape_key(c, 1) for c in contexts] + [shape_key(batch16_context, 16)]
    for w in weights:
        for key in shapes:
            r = res.get(f"ratio_{w}_{key}")
            checks[f"ahead_of_llamacpp_{w}_{key}"] = _ok(r) and r > 1.0
    return checks


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--weights", default=",".join(WEIGHT_TYPES),
                    help=f"weights types, comma-separated, from {', '.join(WEIGHT_TYPES)}")
    ap.add_argument("--contexts", default="512,4096,16384", help="batch-1 contexts, comma-separated")
    ap.add_argument("--batch16-context", type=int, default=512)
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prompt length of the prefill shape (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--load", action="store_true", help="run beside one competing CPU-bound process")
    ap.add_argument("--quant-activations", default="fp32", choices=("fp32", "q8"),
                    help="kvbench's decode products: fp32 activations, or rows quantized to Q8_0 blocks (integer dot "
                         "products with Q8_0 / Q4_0 / Q5_0 / Q4_K / Q6_K weights, as llama.cpp)")
    ap.add_argument(WORKER, action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(MAKE_GGUF, action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--model", "--src", "--dest", "--ftype"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--flash", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def main() -> None:
    args = parse_args()
    if args.llamacpp_worker:
        return worker(args)
    if args.llamacpp_make_gguf:
        return make_gguf(args)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        _refuse(f"--contexts {args.contexts!r}: give comma-separated integers, e.g. 512,4096,16384")
    weights = [w.strip().lower() for w in args.weights.split(",") if w.strip()]
    bad = [w for w in weights if w not in WEIGHT_TYPES]
    if bad or not weights:
        _refuse(f"--weights {args.weights!r}: choose from {', '.join(WEIGHT_TYPES)} (comma-separated)")
    weights = [w for w in WEIGHT_TYPES if w in weights]
    if args.prefill_tokens < 0:
        _refuse(f"--prefill-tokens {args.prefill_tokens}: give a prompt length >= 0 (0: no prefill shape)")
    if not args.llamacpp_python:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is not None:  # the `llamacpp` extra in this interpreter
            args.llamacpp_python = sys.executable
    if not args.llamacpp_python:
        print("llama.cpp comparison skipped: no llama.cpp given (install llama-cpp-python==0.3.36 into a venv and "
              "pass --llamacpp-python VENV/bin/python)")
        return
    if not os.access(args.llamacpp_python, os.X_OK):
        _refuse(f"--llamacpp-python {args.llamacpp_python!r}: not an executable interpreter")

    import kvbench  # noqa: F401  (kvbench's OpenMP wait policy before torch loads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_runtime import competing_process
    from kvbench.runtime.backends.cpu.threads import configure_threads
    from kvbench.runtime.model.loading import load_model
    from kvbench.runtime.model.packaged import cache_root, packaged_smollm2
    from kvbench.runtime.model.quantized_weights import set_quant_activations
    from kvbench.runtime.serving.engine import Engine

    configure_threads(args.threads)
    folder, name = packaged_smollm2()
    files = gguf_files(args, os.path.join(folder, name), str(cache_root() / "llamacpp"), weights)
    shapes = ([(0, 1, args.prefill_tokens)] if args.prefill_tokens else []) + \
        [(c, 1, 0) for c in contexts] + [(args.batch16_context, 16, 0)]
    res: dict[str, float] = {}
    census: dict[str, dict] = {}
    load = competing_process() if args.load else contextlib.nullcontext()
    with load:
        for w in weights:
            model = load_model(files[w], weights="quantized").model  # its weight summary on stderr
            set_quant_activations(model, args.quant_activations)
            census[w] = weights_census(files[w], model)
            print(f"{w}: {os.path.basename(files[w])}  2-D tensors {census[w]['tensor_types']}  "
                  f"({census[w]['tensors_without_kernel']} without a kernel, read as fp32)  projections quantized "
                  f"{census[w]['projections_quantized']}, fp32 {census[w]['projections_fp32']}  weights "
                  f"{model.weight_bytes / 1e6:.1f} MB")
            vocab = model.config.vocab_size
            engine = Engine(model, prefill_chunk_size=512, prefix_caching=False, schedule="prefill_first")
            for ctx, batch, prefill in shapes:
                kv, lc, bws = [], [], []
                for rep in range(args.repeats):  # alternated: kvbench, then llama.cpp (flash attention off, on)
                    if prefill:
                        tps, bw = kvbench_prefill(engine, prefill, vocab, warm_up=rep == 0)
                    else:
                        tps, bw = kvbench_decode(engine, ctx, batch, args.decode_tokens, vocab, warm_up=rep == 0)
                    kv.append(tps)
                    bws.append(bw)
                    runs = [r for r in (run_llamacpp(args, files[w], ctx, batch, fa, prefill) for fa in (False, True))
                            if r]
                    if runs:
                        lc.append(max(runs))
                k = statistics.median(kv)
                key = f"{w}_{shape_key(ctx, batch, prefill)}"
                res[f"kvbench_{key}"] = k
                per_step = batch if not prefill else prefill  # tokens a step (or a prefill pass) produces
                frac = step_bytes(model.weight_bytes, engine.cache.full_bytes_per_token, ctx, batch,
                                  args.decode_tokens, prefill) * (k / per_step) / max(bws)
                res[f"bandwidth_fraction_{key}"] = frac
                what = f"prefill {prefill:5d} tok" if prefill else f"decode batch {batch:2d} ctx {ctx:6d}"
                extra = f"  ({frac:.2f} of copy bandwidth {max(bws) / 1e9:.1f} GB/s)"
                if lc:
                    ll = statistics.median(lc)
                    res[f"llamacpp_{key}"], res[f"ratio_{key}"] = ll, k / ll
                    print(f"{w:6s} {what}  kvbench {k:8.2f} tok/s  llama.cpp {ll:8.2f} tok/s  ratio {k / ll:.2f}"
                          f"{extra}", flush=True)
                else:
                    print(f"{w:6s} {what}  kvbench {k:8.2f} tok/s  llama.cpp failed{extra}", flush=True)
            b1 = res.get(f"kvbench_{w}_b1_ctx{args.batch16_context}")
            if b1:
                res[f"b16_over_b1_{w}_ctx{args.batch16_context}"] = \
                    res[f"kvbench_{w}_b16_ctx{args.batch16_context}"] / b1
            del engine, model
    checks = target_checks(res, contexts, args.batch16_context, tuple(weights), args.prefill_tokens)
    print(f"targets (issues 47 and 66{', under one competing process' if args.load else ''}):")
    for name, ok in checks.items():
        print(f"  {name}: {'PASS' if ok else 'MISS'}")
    res["load"] = 1.0 if args.load else 0.0
    res["quant_activations_q8"] = 1.0 if args.quant_activations == "q8" else 0.0
    print(json.dumps({**{k: round(v, 4) for k, v in res.items()}, "weights": census, "targets": checks}))


if __name__ == "__main__":
    main()
