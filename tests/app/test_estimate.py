"""The line printed before a run: the work from the task's options, a time from the rates this machine measured
(never a figure from the code), the options that shorten it; progress that moves from the first prompt token."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvbench import estimate
from kvbench.tasks import build_task
from kvbench.tasks.base import Workload
from tests.fixtures.task_fixtures import smollm2_tokenizer


@pytest.fixture(autouse=True)
def steady_load(monkeypatch):
    """The other processes' load, as the estimator reads it: 0 unless a test sets `estimate.others_load`."""
    monkeypatch.setattr(estimate, "others_load", lambda: 0.0)


class Recorder:
    """A progress factory that keeps each bar's total and updates."""

    def __init__(self):
        self.bars = []

    def __call__(self, total=None, desc="", unit="it"):
        bar = SimpleNamespace(total=total, desc=desc, updates=[], closed=False)
        bar.update = lambda n=1: bar.updates.append(n)
        bar.close = lambda: setattr(bar, "closed", True)
        self.bars.append(bar)
        return bar


def test_rulers_defaults_say_days_and_how_to_shorten(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    work = build_task("ruler", {}).workload(None)
    assert (work.prompts, work.new_tokens) == (13 * 500, 500 * (8 * 128 + 30 + 120 + 50 + 2 * 32))
    assert work.prompt_tokens == 13 * 500 * 4096 - work.new_tokens
    line = estimate.plan_line("ruler", work, None)
    assert "6,500 prompt(s)" in line and "no speed measured on this machine" in line and "task.limit=N" in line
    estimate.record_speed({"status": "ok", "model": "m", "dtype": "float32", "device": "cpu", "run_id": "r1",
                           "prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 15.0})
    speed = estimate.measured_speed("m", "float32", "cpu")
    assert speed["run_id"] == "r1" and speed["measured_at"]
    seconds = estimate.estimate_seconds(work, speed)
    assert seconds == pytest.approx(work.prompt_tokens / 300.0 + work.new_tokens / 15.0)
    line = estimate.plan_line("ruler", work, speed)
    assert f"about {estimate.duration(seconds)} here" in line and seconds > 86400  # more than a day
    assert "300.0 prefill and 15.0 decode tok/s at load 0.0: the median of 1 run measured on this machine" in line


def test_a_rate_is_kept_only_from_a_run_that_measured_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    base = {"model": "m", "dtype": "float32", "device": "cpu"}
    estimate.record_speed({**base, "status": "ok", "prefill_tokens_per_s": 300.0, "decode_tokens_per_s": 15.0})
    estimate.record_speed({**base, "status": "ok", "prefill_tokens_per_s": 200.0, "decode_tokens_per_s": None})
    estimate.record_speed({**base, "status": "failed", "prefill_tokens_per_s": 1.0, "decode_tokens_per_s": 1.0})
    speed = estimate.measured_speed("m", "float32", "cpu")
    assert (speed["prefill_tokens_per_s"], speed["decode_tokens_per_s"]) == (250.0, 15.0)  # medians of the runs
    assert estimate.measured_speed("m", "bfloat16", "cpu") is None
    no_decode = Workload(1, 100, 10, "x", "y")
    assert estimate.estimate_seconds(no_decode, {"prefill_tokens_per_s": 100.0}) is None  # never a guess


def test_the_line_comes_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from kvbench import app
    from tests.harness_fakes import FakeEngine, compose, fake_build_method, fake_loader

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    loader = fake_loader()

    def load(*args, **kwargs):
        assert "kvbench: perplexity: 1 window(s) of 40 tokens" in capsys.readouterr().out
        return loader(*args, **kwargs)

    cfg = compose([f"results_dir={tmp_path / 'r'}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4"])
    rec = app.run(cfg, load_model_fn=load, engine_cls=FakeEngine, build_method_fn=fake_build_method)
    assert rec["status"] == "ok"
    assert not (tmp_path / "cache" / estimate.SPEED_FILE).exists()  # a fake model's rates are never kept


def test_ruler_counts_its_samples_from_the_first_one():
    progress = Recorder()
    task = build_task("ruler", {"tasks": ["niah_single_1"], "lengths": [512], "limit": 2})
    assert len(task.requests(smollm2_tokenizer(), progress=progress)) == 2
    (bar,) = progress.bars
    assert bar.total == 2 and bar.updates == [1, 1] and bar.closed and "making samples" in bar.desc


def test_throughput_progress_counts_prompt_tokens_from_the_first_chunk(tmp_path):
    from tests.fixtures.task_fixtures import tiny_engine

    progress = Recorder()
    task = build_task("throughput", {"num_requests": 3, "input_tokens": [40, 60], "output_tokens": 4})
    task.output_dir = str(tmp_path)
    res = task.run(tiny_engine(None, block_size=8), smollm2_tokenizer(), SimpleNamespace(seed=0), progress)
    (bar,) = progress.bars
    prompts = sum(s["input_tokens"] for s in res.samples)
    assert bar.total == prompts + 3 * 4 and bar.updates[0] > 1  # the first step was a prompt chunk
    assert sum(bar.updates) == prompts + 3 * (4 - 1)  # every prompt token and every output token fed back


def test_first_use_messages_quote_only_measured_dated_times(tmp_path, monkeypatch):
    import json

    from kvbench.runtime import measured_times

    path = tmp_path / "measured_times.json"
    monkeypatch.setattr(measured_times, "MEASURED", path)
    assert measured_times.quoted("compile") == ""  # never measured: no time is quoted
    path.write_text(json.dumps({"compile": {"seconds": 151.4, "date": "2026-12-03", "cpus": 2}}))
    assert measured_times.quoted("compile") == "took 151 s on a 2-CPU machine (measured 2026-12-03)"
    path.write_text(json.dumps({"compile": {"seconds": 151.4, "date": "2026-12-03", "cpus": 2, "load_avg_1m": 17.2}}))
    assert measured_times.quoted("compile") == "took 151 s on a 2-CPU machine at load 17 (measured 2026-12-03)"
    runs = [{"seconds": 44.2, "date": "2026-12-04", "cpus": 2, "load_avg_1m": 0.6},
            {"seconds": 287.1, "date": "2026-12-03", "cpus": 2, "load_avg_1m": 14.75}]
    path.write_text(json.dumps({"compile": {**runs[0], "runs": runs[::-1]}}))
    assert measured_times.quoted("compile") == \
        "took 44 s at load 0.6 to 287 s at load 15 on a 2-CPU machine (measured 2026-12-03, 2026-12-04)"


def test_the_record_is_a_robust_figure_per_machine_setting(tmp_path, monkeypatch):
    """Issue 67 item 3: one record per (model, dtype, device, threads, CPU kind); the median of the recent runs, so
    a run slowed by a competing process (or a runtime.threads=1 run) does not set the next estimate."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    base = {"model": "m", "dtype": "float32", "device": "cpu", "status": "ok", "decode_tokens_per_s": 10.0}
    for rate in (100.0, 110.0, 5.0, 105.0):  # 5.0: a run beside a busy process
        estimate.record_speed({**base, "prefill_tokens_per_s": rate})
    estimate.record_speed({**base, "prefill_tokens_per_s": 1.0}, threads=1)  # another setting: its own record
    speed = estimate.measured_speed("m", "float32", "cpu")
    assert speed["prefill_tokens_per_s"] == 102.5 and speed["runs"] == 4
    assert estimate.measured_speed("m", "float32", "cpu", 1)["prefill_tokens_per_s"] == 1.0
    for _ in range(estimate.KEEP):  # only the newest KEEP runs count
        estimate.record_speed({**base, "prefill_tokens_per_s": 50.0})
    assert estimate.measured_speed("m", "float32", "cpu")["prefill_tokens_per_s"] == 50.0
    data = json.loads((tmp_path / estimate.SPEED_FILE).read_text())
    (key,) = [k for k in data if "threads=auto" in k]
    assert key.endswith(estimate.cpu_kind()) and len(data[key]["runs"]) == estimate.KEEP
    monkeypatch.setattr(estimate, "cpu_kind", lambda: "another CPU")  # another machine kind: nothing measured yet
    assert estimate.measured_speed("m", "float32", "cpu") is None


def test_the_estimate_holds_the_load_the_logger_and_the_tasks_overhead(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    work = Workload(2, 1000, 100, "x", "y")
    base = {"model": "m", "dtype": "float32", "device": "cpu", "status": "ok", "task": "perplexity",
            "prefill_tokens_per_s": 100.0, "decode_tokens_per_s": 10.0, "logger_start_s": 1.0}
    # 10 s of prefill + 10 s of decode + 1 s logger + 8 s load: 30 s of wall time leaves 1 s of overhead
    estimate.record_speed({**base, "load_s": 8.0, "wall_s": 30.0}, workload=work)
    estimate.record_speed({**base, "load_s": 0.01, "model_cached": True, "wall_s": 22.0}, workload=work)
    speed = estimate.measured_speed("m", "float32", "cpu")
    assert speed["load_s"] == 8.0  # a model held from an earlier run of the process is no load time
    assert speed["overhead_s"] == {"perplexity": pytest.approx(0.995)}  # the median of 1.0 and 22 - 0.01 - 1 - 20
    assert estimate.estimate_seconds(work, speed, task="perplexity") == pytest.approx(30.0, abs=0.02)
    assert estimate.estimate_seconds(work, speed, model_loaded=True, task="perplexity") == \
        pytest.approx(22.0, abs=0.02)
    line = estimate.plan_line("perplexity", work, speed)
    assert "about 30 s here (model load 8 s, 100.0 prefill and 10.0 decode tok/s at load 0.0: the median of 2 runs" in line
    assert "model load" not in estimate.plan_line("perplexity", work, speed, model_loaded=True)


@pytest.mark.parametrize("name,options,prompts,new", [
    ("longbench", {"datasets": ["qasper", "hotpotqa"], "limit": 5}, 10, 5 * 128 + 5 * 32),
    ("gsm8k", {"limit": 3, "max_new_tokens": 256}, 3, 3 * 256),
    ("aime", {"limit": 2, "sets": [2024, 2025], "num_samples": 2}, 8, 8 * 32768),
])
def test_longbench_and_the_reasoning_tasks_print_their_work(name, options, prompts, new):
    work = build_task(name, options).workload(None)
    assert (work.prompts, work.new_tokens, work.exact) == (prompts, new, False)
    line = estimate.plan_line(name, work, None)
    assert f"= {prompts} prompt(s)" in line and "task.limit=N" in line
