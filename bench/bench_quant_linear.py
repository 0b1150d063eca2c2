"""Weights kept in GGUF's quantized blocks (model.weights=quantized) against the fp32 path (model.weights=dequantize).

1. GEMV (decode, one row) and a prefill chunk (--prefill rows) through a 4096 x 4096 matrix of each block type
   (--types; random blocks), with the quantized kernels (backends/cpu/quant_linear.py, the ISA this CPU runs, or
   KVBENCH_QUANT_ISA) against torch's fp32 matmul of the same matrix de-quantized, best of --repeats: ms a call, GB/s
   of weight bytes read (the file's bytes for the kernels, 4 bytes a weight for fp32) and the ratio of times; also the
   process's CPU time a call (time.process_time), steadier than wall time when other processes share the cores.
2. --rss: the peak resident memory (getrusage ru_maxrss) of loading --model and decoding --tokens tokens, in a fresh
   process per weights mode, and the resident memory after the load (the weights held; the peak also holds the
   transformers model the weights are read from).
The last line is one JSON object.

    python bench/bench_quant_linear.py [--threads 2] [--repeats 5] [--types Q8_0,Q4_K] [--rss] [--model gemma-3-270m]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

DIM = 4096


def best_time(fn, repeats: int, inner: int, clock=time.perf_counter) -> float:
    """Seconds per call: the best of `repeats` means over `inner` calls, after two warm-up calls; `clock`
    time.process_time gives the process's CPU seconds (steadier than wall time on a shared machine)."""
    fn(), fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - t0) / inner)
    return best


def gemv_rows(types: list[str], repeats: int, prefill: int) -> list[dict]:
    from kvbench.runtime.backends.cpu import quant_linear as ql

    g = torch.Generator().manual_seed(0)
    out = []
    for name in types:
        qm = ql.random_quant_matrix(name, DIM, DIM, g)
        dense = qm.dequantize()  # [out, in] fp32
        for rows in (1, prefill):
            x = torch.randn(rows, DIM, generator=g)
            got, ref = ql.quant_matmul(x, qm), x @ dense.T
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), name
            inner = 20 if rows == 1 else 2
            tq = best_time(lambda: ql.quant_matmul(x, qm), repeats, inner)
            tf = best_time(lambda: x @ dense.T, repeats, inner)
            cq = best_time(lambda: ql.quant_matmul(x, qm), repeats, inner, time.process_time)
            cf = best_time(lambda: x @ dense.T, repeats, inner, time.process_time)
            out.append(dict(type=name, rows=rows, isa=ql.chosen_isa(), quant_ms=round(tq * 1e3, 3),
                            fp32_ms=round(tf * 1e3, 3), quant_gbps=round(qm.data.nbytes / tq / 1e9, 2),
                            fp32_gbps=round(dense.nbytes / tf / 1e9, 2), speedup=round(tf / tq, 2),
                            quant_cpu_ms=round(cq * 1e3, 3), fp32_cpu_ms=round(cf * 1e3, 3),
                            cpu_speedup=round(cf / cq, 2)))
            print(f"{name:5} rows={rows:4} quantized {tq * 1e3:8.3f} ms ({out[-1]['quant_gbps']:6.2f} GB/s)   "
                  f"fp32 {tf * 1e3:8.3f} ms ({out[-1]['fp32_gbps']:6.2f} GB/s)   x{out[-1]['speedup']}   "
                  f"CPU time {cq * 1e3:.3f} / {cf * 1e3:.3f} ms (x{out[-1]['cpu_speedup']})", flush=True)
    return out


_RSS_CHILD = """
import json, resource, sys, torch
from kvbench.runtime.model.loading import load_model
from kvbench.runtime.serving.engine import Engine
torch.set_num_threads({threads})
loaded = load_model({model!r}, weights={weights!r})
def rss():
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS')) / 1024
after_load = rss()
ids = loaded.tokenizer('The quick brown fox jumps over the lazy dog. ' * 4)['input_ids']
engine = Engine(loaded.model, prefill_chunk_size=64)
out = engine.generate([ids], max_new_tokens={tokens})[0].token_ids
print(json.dumps(dict(weights={weights!r}, rss_after_load_mb=round(after_load, 1),
                      peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      weight_mb=round(loaded.model.weight_bytes / 2**20, 1), tokens=list(out)[:8])))
"""


def rss_rows(model: str, tokens: int, threads: int) -> list[dict]:
    rows = []
    for weights in ("quantized", "dequantize"):
        code = _RSS_CHILD.format(threads=threads, model=model, weights=weights, tokens=tokens)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--types", default="Q8_0,Q4_K", help="block types of the GEMV rows (empty: none)")
    ap.add_argument("--prefill", type=int, default=64, help="rows of the prefill-chunk measurement")
    ap.add_argument("--rss", action="store_true", help="also the peak RSS of --model in both weights modes")
    ap.add_argument("--model", default="packaged:gemma-3-270m")
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = dict(bench="quant_linear", machine=platform.processor() or platform.machine(), threads=args.threads,
                  load_average=round(os.getloadavg()[0], 2), dim=DIM,
                  gemv=gemv_rows([t for t in args.types.split(",") if t], args.repeats, args.prefill))
    if args.rss:
        result["rss"] = rss_rows(args.model, args.tokens, args.threads)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
