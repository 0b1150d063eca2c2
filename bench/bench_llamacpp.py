"""kvbench against llama.cpp: decode tok/s of the same SmolLM2-135M weights in F32, same threads, runs alternated.

llama.cpp comes from the `llama_cpp` Python bindings (llama-cpp-python from PyPI, built from its sdist) of the
interpreter given with --llamacpp-python; it runs in a child process of that interpreter (this file in worker mode,
which imports only llama_cpp), through the low-level API: a prefill of the context with llama_decode, then timed
llama_decode calls of one token per sequence (batch 1 at each context; 16 sequences in one llama_batch for batch
16), flash attention off and on, the faster reported. The packaged Q4_1 GGUF is converted once to F32 with the
bindings' llama_model_quantize (ftype ALL_F32), so both sides multiply the same fp32 weights. llama.cpp's side feeds
a fixed next token (no sampling); kvbench's decode steps include its greedy sampling.

Both sides are timed warm. llama.cpp clears its whole KV buffer when its context is created, before any timed
step, and its first decode step (graph set-up for one-token batches) is run untimed. kvbench's pool is virtual
until written (runtime.kv_memory_bytes, 4 GiB by default), so a run's first pass through fresh blocks pays the
kernel's page faults: on the 2-core dev VM, batch 16's tables took their new blocks in 27-30 ms at each block
boundary on fresh pages, against 3-4 ms on pages written before. Each shape therefore gets one untimed kvbench run of the same prompts and length first (as a server's pool
is warm after its first requests), then the timed runs.

Without --llamacpp-python (and without llama_cpp in this interpreter: the `llamacpp` extra) the script prints one line saying it is skipped and how to enable it (CI never needs it):

    python3 -m venv /tmp/llamacpp_env && CMAKE_ARGS="-DGGML_NATIVE=ON" /tmp/llamacpp_env/bin/pip install \\
        llama-cpp-python==0.3.36
    python bench/bench_llamacpp.py --llamacpp-python /tmp/llamacpp_env/bin/python [--contexts 512,4096,16384]

kvbench's batch-1 figures also give the fraction of the memory-bandwidth limit they reach: bytes a decode step must
read (weights + the K/V of the context) x steps/s, over the best copy bandwidth (read + write of a large tensor)
measured before and after each kvbench run. `--load` runs everything beside one competing CPU-bound process (as on
a shared node). The targets of issue 47 are printed as verdicts (`target_checks`): batch 16 at least 6x batch 1 at
context 512 and ahead of llama.cpp's batched figure, batch 1 at context 4,096 at >= 0.85 of copy bandwidth, and
kvbench ahead of llama.cpp at every shape measured.

The last line is one JSON object: per shape kvbench and llama.cpp tok/s and their ratio, kvbench's bandwidth
fractions, batch 16 over batch 1, and the verdicts.
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


# ---------------------------------------------------------------------------------- llama.cpp worker (child)
def worker(args) -> None:
    """Child mode, run by the llama-cpp-python interpreter: decode tok/s of one shape, printed as JSON."""
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    quiet = L.llama_log_callback(lambda *a: None)  # kept referenced while llama.cpp may call it
    L.llama_log_set(quiet, ctypes.c_void_p(0))
    if not os.path.exists(args.f32):  # the F32 copy of the packaged GGUF, made once
        qp = L.llama_model_quantize_default_params()
        qp.ftype = L.LLAMA_FTYPE_ALL_F32
        qp.nthread = args.threads
        qp.allow_requantize = True  # the packaged GGUF's token embedding is q8_0: dequantized, not requantized
        tmp = args.f32 + ".tmp"
        if L.llama_model_quantize(args.gguf.encode(), tmp.encode(), ctypes.byref(qp)) != 0:
            raise SystemExit(f"llama_model_quantize of {args.gguf} to F32 failed")
        os.replace(tmp, args.f32)
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(args.f32.encode(), mp)
    S, ctx_len, n = args.batch, args.ctx, args.decode_tokens
    cp = L.llama_context_default_params()
    cp.n_ctx = S * (ctx_len + n + 9)
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = S
    cp.n_threads = cp.n_threads_batch = args.threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    batch = L.llama_batch_init(512, 0, S)

    def decode(items: list[tuple[int, int, int]], last_logits: bool) -> None:  # (token, pos, seq)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = last_logits
        if L.llama_decode(ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    import random

    rng = random.Random(ctx_len)
    for s in range(S):  # prefill, 512 tokens per call
        toks = [rng.randrange(100, n_vocab - 100) for _ in range(ctx_len)]
        for a in range(0, ctx_len, 512):
            chunk = [(t, a + i, s) for i, t in enumerate(toks[a:a + 512])]
            decode(chunk, False)
    decode([(999, ctx_len, s) for s in range(S)], True)  # untimed: the first one-token step sets up its graph
    times = []
    for step in range(n):
        t = time.perf_counter()
        decode([(1000 + step, ctx_len + 1 + step, s) for s in range(S)], True)
        times.append(time.perf_counter() - t)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"tokens_per_s": S * len(times) / sum(times)}))


def run_llamacpp(args, f32: str, gguf: str, ctx: int, batch: int, flash: bool) -> float | None:
    cmd = [args.llamacpp_python, os.path.abspath(__file__), WORKER, "--f32", f32, "--gguf", gguf, "--ctx", str(ctx),
           "--batch", str(batch), "--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    if flash:
        cmd.append("--flash")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["tokens_per_s"]
    except (IndexError, ValueError, KeyError):
        print(f"llama.cpp run failed (ctx {ctx}, batch {batch}, flash {flash}): {proc.stderr.strip()[-400:]}",
              file=sys.stderr)
        return None


# ---------------------------------------------------------------------------------- kvbench side
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


def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x)


def target_checks(res: dict, contexts: list[int], batch16_context: int = 512) -> dict[str, bool]:
    """Issue 47's targets from the bench's figures: name -> met. A missing, None or NaN figure is not met."""
    b1, b16 = res.get(f"kvbench_b1_ctx{batch16_context}"), res.get(f"kvbench_b16_ctx{batch16_context}")
    ratio = b16 / b1 if _ok(b1) and _ok(b16) and b1 > 0 else None
    frac = res.get("bandwidth_fraction_b1_ctx4096")
    checks = {
        f"b16_over_b1_ctx{batch16_context}_ge_6": _ok(ratio) and ratio >= 6.0,
        "bandwidth_fraction_b1_ctx4096_ge_0.85": _ok(frac) and frac >= 0.85,
    }
    for key in [f"b1_ctx{c}" for c in contexts] + [f"b16_ctx{batch16_context}"]:
        r = res.get(f"ratio_{key}")
        checks[f"ahead_of_llamacpp_{key}"] = _ok(r) and r > 1.0
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp-python", default=None, help="an interpreter with llama-cpp-python installed")
    ap.add_argument("--contexts", default="512,4096,16384", help="batch-1 contexts, comma-separated")
    ap.add_argument("--batch16-context", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--load", action="store_true", help="run beside one competing CPU-bound process")
    ap.add_argument(WORKER, action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--f32", "--gguf"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=512, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--flash", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llamacpp_worker:
        return worker(args)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        print(f"--contexts {args.contexts!r}: give comma-separated integers, e.g. 512,4096,16384", file=sys.stderr)
        sys.exit(2)
    if not args.llamacpp_python:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is not None:  # the `llamacpp` extra in this interpreter
            args.llamacpp_python = sys.executable
    if not args.llamacpp_python:
        print("llama.cpp comparison skipped: no llama.cpp given (install llama-cpp-python==0.3.36 into a venv and "
              "pass --llamacpp-python VENV/bin/python)")
        return
    if not os.access(args.llamacpp_python, os.X_OK):
        print(f"--llamacpp-python {args.llamacpp_python!r}: not an executable interpreter", file=sys.stderr)
        sys.exit(2)

    import kvbench  # noqa: F401  (kvbench's OpenMP wait policy before torch loads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_runtime import competing_process
    from kvbench.runtime.backends.cpu.threads import configure_threads
    from kvbench.runtime.model.loading import load_model, packaged_smollm2
    from kvbench.runtime.serving.engine import Engine

    configure_threads(args.threads)
    folder, name = packaged_smollm2()
    gguf = os.path.join(folder, name)
    cache = os.path.join(os.path.expanduser("~"), ".cache", "kvbench", "llamacpp")
    os.makedirs(cache, exist_ok=True)
    f32 = os.path.join(cache, name.replace(".Q4_1.gguf", ".F32.gguf"))
    lm = load_model(dtype="float32")
    model = lm.model
    vocab = model.config.vocab_size
    engine = Engine(model, prefill_chunk_size=512, prefix_caching=False, schedule="prefill_first")
    shapes = [(c, 1) for c in contexts] + [(args.batch16_context, 16)]
    res: dict[str, float] = {}
    load = competing_process() if args.load else contextlib.nullcontext()
    with load:
        for ctx, batch in shapes:
            kv, lc, bws = [], [], []
            for rep in range(args.repeats):  # alternated: kvbench, then llama.cpp (flash attention off, on)
                tps, bw = kvbench_decode(engine, ctx, batch, args.decode_tokens, vocab, warm_up=rep == 0)
                kv.append(tps)
                bws.append(bw)
                runs = [r for r in (run_llamacpp(args, f32, gguf, ctx, batch, fa) for fa in (False, True)) if r]
                if runs:
                    lc.append(max(runs))
            k = statistics.median(kv)
            key = f"b{batch}_ctx{ctx}"
            res[f"kvbench_{key}"] = k
            extra = ""
            if batch == 1:  # weights + the K/V of the context (and half the new tokens) read per step
                step_bytes = model.weight_bytes + (ctx + args.decode_tokens // 2) * engine.cache.full_bytes_per_token
                frac = step_bytes * k / max(bws)
                res[f"bandwidth_fraction_{key}"] = frac
                extra = f"  ({frac:.2f} of copy bandwidth {max(bws) / 1e9:.1f} GB/s)"
            if lc:
                ll = statistics.median(lc)
                res[f"llamacpp_{key}"], res[f"ratio_{key}"] = ll, k / ll
                print(f"decode batch {batch:2d} ctx {ctx:6d}  kvbench {k:8.2f} tok/s  llama.cpp {ll:8.2f} tok/s  "
                      f"ratio {k / ll:.2f}{extra}")
            else:
                print(f"decode batch {batch:2d} ctx {ctx:6d}  kvbench {k:8.2f} tok/s  llama.cpp failed{extra}")
    b1 = res.get(f"kvbench_b1_ctx{args.batch16_context}")
    if b1:
        res[f"b16_over_b1_ctx{args.batch16_context}"] = res[f"kvbench_b16_ctx{args.batch16_context}"] / b1
    checks = target_checks(res, contexts, args.batch16_context)
    print(f"targets (issue 47{', under one competing process' if args.load else ''}):")
    for name, ok in checks.items():
        print(f"  {name}: {'PASS' if ok else 'MISS'}")
    res["load"] = 1.0 if args.load else 0.0
    print(json.dumps({**{k: round(v, 4) for k, v in res.items()}, "targets": checks}))


if __name__ == "__main__":
    main()
