"""task=throughput on the tiny model: the seeded trace, the serving metrics, the timeline files, bad options."""
from __future__ import annotations

import csv
import math
from types import SimpleNamespace

import pytest

from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.tasks import build_task, no_progress
from kvbench.tasks.throughput import ThroughputOptions, build_trace
from tests.fixtures.task_fixtures import one_thread as _one_thread
from tests.fixtures.task_fixtures import smollm2_tokenizer, tiny_engine

one_thread = pytest.fixture(scope="module", autouse=True)(_one_thread)

OPTS = {"num_requests": 6, "input_tokens": [40, 160], "output_tokens": [3, 9]}


def _run(tmp_path, method=None, seed=0, **engine_kw):
    task = build_task("throughput", OPTS)
    tmp_path.mkdir(parents=True, exist_ok=True)
    task.output_dir = str(tmp_path)
    engine = tiny_engine(method, block_size=8, **engine_kw)
    return task.run(engine, smollm2_tokenizer(), SimpleNamespace(seed=seed), no_progress), engine


def test_trace_is_seeded_and_within_the_ranges():
    stream = list(range(5000))
    opts = ThroughputOptions(num_requests=20, input_tokens=[10, 50], output_tokens=7, request_rate=4.0)
    a, b, c = build_trace(stream, opts, 1), build_trace(stream, opts, 1), build_trace(stream, opts, 2)
    assert [(t.prompt_ids, t.output_tokens, t.arrival_s) for t in a] == [
        (t.prompt_ids, t.output_tokens, t.arrival_s) for t in b]
    assert [t.prompt_ids for t in a] != [t.prompt_ids for t in c]
    assert all(10 <= len(t.prompt_ids) <= 50 and t.output_tokens == 7 for t in a)
    arrivals = [t.arrival_s for t in a]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0  # Poisson: exponential gaps
    offline = build_trace(stream, ThroughputOptions(num_requests=5), 0) if len(stream) >= 4096 else None
    assert offline is not None and all(t.arrival_s == 0.0 for t in offline)


def test_serving_metrics_and_timeline(tmp_path):
    res, engine = _run(tmp_path, kv_memory_bytes=60 * 8 * 2 * 16 * 4 * 4)  # about 240 tokens per table set
    m = res.metrics
    assert m["completed_requests"] == 6 and m["failed_requests"] == 0
    assert m["output_tokens"] == sum(s["output_tokens"] for s in res.samples)
    assert all(3 <= s["output_tokens"] <= 9 for s in res.samples)  # exactly as drawn: EOS ignored
    assert m["output_tokens_per_s"] > 0 and m["total_tokens_per_s"] > m["output_tokens_per_s"]
    assert m["ttft_s_p50"] <= m["ttft_s_p90"] <= m["ttft_s_p99"] and m["e2e_s_p50"] <= m["e2e_s_p99"]
    assert 1 <= m["mean_running_seqs"] <= m["max_running_seqs"] <= 6
    assert m["kv_pool_bytes"] == engine.cache.pool_bytes()
    rows = list(csv.DictReader(open(tmp_path / "timeline.csv")))
    kinds = {r["kind"] for r in rows}
    assert len(rows) == m["steps"] and {"prefill", "decode"} <= kinds <= {"prefill", "decode", "mixed"}
    assert max(int(r["blocks_in_use"]) for r in rows) <= int(rows[0]["pool_blocks"])
    # the decode rate (decode-only steps) and the end-to-end output rate (prefill included) under their own names
    ends = [float(r["t_s"]) for r in rows]
    decode = [(float(r["t_s"]) - start, int(r["tokens"])) for r, start in zip(rows, [0.0] + ends[:-1])
              if r["kind"] == "decode"]
    assert m["decode_tokens_per_s"] == pytest.approx(sum(n for _, n in decode) / sum(t for t, _ in decode), rel=0.05)
    assert res.perf["decode_tokens_per_s"] == m["decode_tokens_per_s"] > m["output_tokens_per_s"]
    if m.get("timeline_png"):
        assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert engine.cache.pool.in_use == 0


def test_compression_runs_more_sequences_at_fixed_memory(tmp_path):
    mem = 40 * 8 * 2 * 16 * 4 * 4
    full, _ = _run(tmp_path / "a", kv_memory_bytes=mem)
    pe, _ = _run(tmp_path / "b", build_method("paged_eviction", 32), kv_memory_bytes=mem)
    assert pe.metrics["completed_requests"] == 6
    assert pe.metrics["max_running_seqs"] > full.metrics["max_running_seqs"]
    assert pe.metrics["preemptions"] <= full.metrics["preemptions"]


@pytest.mark.parametrize("opts,match", [
    ({"num_requests": 0}, "task.num_requests=0"),
    ({"request_rate": 0}, "task.request_rate=0"),
    ({"request_rate": -2.5}, "task.request_rate=-2.5"),
    ({"input_tokens": [500, 100]}, "task.input_tokens"),
    ({"output_tokens": "many"}, "task.output_tokens='many'"),
    ({"input_tokens": [1, 2, 3]}, "task.input_tokens"),
])
def test_bad_options_are_one_line(opts, match):
    with pytest.raises(UserError, match=match):
        build_task("throughput", opts)


def test_preflight_refuses_lengths_beyond_the_model():
    task = build_task("throughput", {"input_tokens": [1024, 8192]})
    with pytest.raises(UserError, match="exceed the model's 8192"):
        task.preflight(SimpleNamespace(seed=0), SimpleNamespace(max_positions=8192))
    task.preflight(SimpleNamespace(seed=0), None)  # unknown shape: checked again at run time
    assert math.isinf(build_task("throughput", {"request_rate": ".inf"}).options.request_rate)


def test_shared_prefix_tokens_put_the_same_head_on_every_request():
    from kvbench.errors import UserError
    from kvbench.tasks.throughput import ThroughputOptions, build_trace

    stream = list(range(5000))
    opts = ThroughputOptions(num_requests=5, input_tokens=[300, 400], output_tokens=4, shared_prefix_tokens=128)
    trace = build_trace(stream, opts, seed=3)
    plain = build_trace(stream, ThroughputOptions(num_requests=5, input_tokens=[300, 400], output_tokens=4), seed=3)
    assert all(t.prompt_ids[:128] == stream[:128] for t in trace)
    assert [len(t.prompt_ids) for t in trace] == [len(t.prompt_ids) for t in plain]  # lengths as drawn
    for bad in (-1, 300, True, "x"):
        with pytest.raises(UserError, match="task.shared_prefix_tokens"):
            ThroughputOptions(input_tokens=[300, 400], shared_prefix_tokens=bad)


def test_decode_prefill_share_counts_the_steps_with_prompt_tokens_in_each_decode_life():
    from kvbench.runtime.serving.requests import StepRecord
    from kvbench.tasks.throughput import decode_prefill_shares

    def step(t, kind):
        return StepRecord(t, kind, running=2, waiting=0, blocks_in_use=1, tokens=1)

    # steps end at 1, 2, 4, 5, 8: [0,1) prefill, [1,2) decode, [2,4) mixed, [4,5) decode, [5,8) prefill
    steps = [step(1, "prefill"), step(2, "decode"), step(4, "mixed"), step(5, "decode"), step(8, "prefill")]
    a = SimpleNamespace(output=[1, 2, 3, 4], first_token_s=0.9, finish_s=4.9)  # steps from 1, 2 and 4: 1 + 2 + 1 s
    b = SimpleNamespace(output=[1, 2], first_token_s=1.5, finish_s=4.5)  # steps from 2 and 4: 2 of 3 s mixed
    quiet = SimpleNamespace(output=[1, 2], first_token_s=0.9, finish_s=1.9)  # the decode step from 1 only
    single = SimpleNamespace(output=[1], first_token_s=0.9, finish_s=0.9)  # no decode life: left out
    shares = decode_prefill_shares([a, b, quiet, single], steps)
    assert shares == pytest.approx([2 / 4, 2 / 3, 0.0])
    assert decode_prefill_shares([single], steps) == []


def test_progress_never_reads_over_100_percent_under_recompute_preemption(tmp_path, monkeypatch):
    # issue 56: a prompt recomputed after preemption is counted again; the total grows with it (it read 104%)
    import io
    import re

    from kvbench.tasks import make_progress

    monkeypatch.setenv("KVBENCH_PROGRESS_INTERVAL", "0")  # a line per step (stderr not a terminal: LogProgress)
    out = io.StringIO()
    task = build_task("throughput", {"num_requests": 8, "input_tokens": [60, 160], "output_tokens": [20, 40]})
    task.output_dir = str(tmp_path)
    engine = tiny_engine(None, block_size=8, kv_memory_bytes=30 * 8 * 2 * 16 * 4 * 4)
    res = task.run(engine, smollm2_tokenizer(), SimpleNamespace(seed=0), make_progress(True, stream=out))
    assert res.metrics["preemptions"] > 0  # the case: a pool small enough to preempt (by recompute)
    pcts = [int(p) for p in re.findall(r"\((\d+)%\)", out.getvalue())]
    assert pcts and max(pcts) <= 100 and pcts[-1] == 100, out.getvalue()[-500:]
