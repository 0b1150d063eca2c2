"""The line printed before a run: the work from the task's options, a time from the rates this machine measured
(never a figure from the code), the options that shorten it; progress that moves from the first prompt token."""
from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from kvbench.run import estimate
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
    from kvbench.run import app
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


# ---------------------------------------------------------------------------------------------- issue 67 item 3
def _run(rate=None, task="perplexity", method="full", quant="none", model="m", **extra):
    """A finished run's record, as app.run gives record_speed."""
    return {"model": model, "dtype": "float32", "device": "cpu", "status": "ok", "task": task, "method": method,
            "quant": quant, "prefill_tokens_per_s": rate, **extra}


def _record_at(monkeypatch, load, record, **kwargs):
    """record_speed for a run that ran beside `load` other runnable processes on a 2-CPU machine."""
    monkeypatch.setattr(estimate, "others_load", lambda: load)
    monkeypatch.setattr(estimate.os, "cpu_count", lambda: 2)
    estimate.record_speed(record, load_at_start=load, **kwargs)


def _speed(load, model="m", **kwargs):
    kwargs.setdefault("task", "perplexity")
    kwargs.setdefault("method", "full")
    return estimate.measured_speed(model, "float32", "cpu", load=load, cpus=2, **kwargs)


def test_runs_at_a_like_load_set_the_estimate(tmp_path, monkeypatch):
    """A run beside busy processes keeps its load: an idle machine's estimate comes from idle runs, a loaded one's
    from loaded runs; between them each run is scaled by the contention, max(1, (load + threads) / cpus)."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    for rate in (100.0, 104.0, 96.0):
        _record_at(monkeypatch, 0.0, _run(rate))
    for rate in (30.0, 20.0, 25.0):
        _record_at(monkeypatch, 6.0, _run(rate))
    idle, busy, between = _speed(0.0), _speed(6.0), _speed(2.0)
    assert idle["prefill_tokens_per_s"] == 100.0 and idle["runs"] == 3 and idle["measured_load"] == (0.0, 0.0)
    assert busy["prefill_tokens_per_s"] == 25.0 and busy["measured_load"] == (6.0, 6.0)
    # load 2 on 2 CPUs with 2 threads: 2x slower than idle, 2x faster than load 6 (4x): both sets as far, both used
    assert between["prefill_tokens_per_s"] == pytest.approx(statistics.median([50, 52, 48, 60, 40, 50]))
    assert estimate.slowdown(6.0, 2, 2) == 4.0 and estimate.slowdown(1.0, 2, 1) == 1.0  # one thread: a CPU free
    work = Workload(1, 1000, 0, "x", "y")
    assert "10.0 prefill tok/s at load 0.0: the median of 3 runs measured on this machine at load 0.0" in \
        estimate.plan_line("perplexity", work, idle).replace("100.0", "10.0")
    assert estimate.estimate_seconds(work, busy) == pytest.approx(4 * estimate.estimate_seconds(work, idle))


def test_the_load_is_the_runnable_tasks_now_not_the_lagging_average(monkeypatch):
    """others_load counts the tasks runnable now besides the reader (a busy process counts at once, not a minute
    later), and falls back to the 1-minute load average where /proc/stat cannot be read."""
    import subprocess
    import sys

    monkeypatch.undo()  # the real reader, not the autouse fixture's 0
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert estimate.others_load() >= 1.0
    finally:
        busy.kill()
        busy.wait()
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: (_ for _ in ()).throw(OSError("no /proc"))
                        if path == "/proc/stat" else real_open(path, *a, **k))
    monkeypatch.setattr(estimate.os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    assert 6.0 <= estimate.others_load() <= 7.0


def test_the_tokens_a_task_generates_are_its_runs_measured_share_of_the_most(tmp_path, monkeypatch):
    """A generation task may generate up to max_new_tokens per prompt; its answers stop earlier. Each run keeps the
    share it generated; the estimate counts the median share of the same task's runs (the same method first), the
    most where none ran, and a run's overhead is figured from what it did generate."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    work = Workload(3, 3000, 300, "x", "y")  # up to 300 generated
    assert estimate.measured_speed("m", "float32", "cpu", load=0.0, cpus=2) is None
    for generated in (30, 60, 90):  # 10%, 20%, 30% of the most
        _record_at(monkeypatch, 0.0, _run(1000.0, task="ruler", method="snapkv", decode_tokens_per_s=10.0,
                                          generated_tokens=generated, wall_s=3.0 + generated / 10.0), workload=work)
    _record_at(monkeypatch, 0.0, _run(1000.0, task="ruler", method="knorm", decode_tokens_per_s=10.0,
                                      generated_tokens=300, wall_s=33.0), workload=work)
    snapkv = _speed(0.0, task="ruler", method="snapkv")
    assert snapkv["generated_fraction"] == pytest.approx(0.2)
    assert any("generated 20% of the most" in b for b in snapkv["basis"])
    assert estimate.token_seconds(work, snapkv) == pytest.approx(3.0 + 60 / 10.0)
    assert _speed(0.0, task="ruler", method="full")["generated_fraction"] == pytest.approx(0.25)  # the task's runs
    assert "generated_fraction" not in _speed(0.0, task="needle", method="snapkv")  # another task: the most
    assert estimate.token_seconds(work, _speed(0.0, task="needle", method="snapkv")) == pytest.approx(3.0 + 30.0)
    runs = next(iter(json.loads((tmp_path / estimate.SPEED_FILE).read_text()).values()))["runs"]
    assert [r["generated_fraction"] for r in runs] == [0.1, 0.2, 0.3, 1.0]
    assert all(r["overhead_s"] == pytest.approx(0.0, abs=1e-6) for r in runs)  # wall = its tokens' time exactly
    _record_at(monkeypatch, 0.0, _run(1000.0, task="ruler", method="snapkv", decode_tokens_per_s=10.0,
                                      generated_tokens=float("nan"), wall_s=3.0), workload=work)
    assert "generated_fraction" not in next(iter(json.loads((tmp_path / estimate.SPEED_FILE).read_text())
                                                  .values()))["runs"][-1]  # a NaN count is not kept


def test_idle_runs_scale_to_the_load_now_and_runs_without_a_load_count_last(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    _record_at(monkeypatch, 0.0, _run(100.0, load_s=4.0))
    loaded = _speed(2.0)
    assert loaded["prefill_tokens_per_s"] == 50.0 and loaded["load_s"] == 8.0  # 2x the contention: half the rate
    assert "at load 2.0: the median of 1 run measured on this machine at load 0.0" in \
        estimate.plan_line("perplexity", Workload(1, 100, 0, "x", "y"), loaded)
    data = json.loads((tmp_path / estimate.SPEED_FILE).read_text())
    (key,) = data
    data[key]["runs"].insert(0, {"prefill_tokens_per_s": 10.0, "task": "perplexity", "method": "full"})  # no load
    (tmp_path / estimate.SPEED_FILE).write_text(json.dumps(data))
    assert _speed(0.0)["prefill_tokens_per_s"] == 100.0  # a run with its load wins over one of unknown load
    data[key]["runs"] = data[key]["runs"][:1]
    (tmp_path / estimate.SPEED_FILE).write_text(json.dumps(data))
    assert _speed(5.0)["prefill_tokens_per_s"] == 10.0  # only runs of unknown load: used as they are


def test_a_codec_or_method_of_its_own_speed_is_estimated_from_its_runs_or_its_factor(tmp_path, monkeypatch):
    """kivi's codec (or quest's page scoring) changes the rates: its own runs first; a model never run with it
    takes its plain runs times the factor measured on another model of this CPU."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    for rate in (100.0, 100.0):
        _record_at(monkeypatch, 0.0, _run(rate, method="paged_eviction", model="a"))
    _record_at(monkeypatch, 0.0, _run(50.0, method="paged_eviction", quant="kivi", model="a"))
    _record_at(monkeypatch, 0.0, _run(200.0, method="paged_eviction", model="b"))
    runs = json.loads((tmp_path / estimate.SPEED_FILE).read_text())
    assert {r["method"] for k, e in runs.items() if k.startswith("a|") for r in e["runs"]} == \
        {"paged_eviction", "paged_eviction+kivi"}
    kivi = "paged_eviction+kivi"
    assert _speed(0.0, model="a", method=kivi)["prefill_tokens_per_s"] == 50.0  # its own run
    assert _speed(0.0, model="a", method="paged_eviction")["prefill_tokens_per_s"] == 100.0
    b = _speed(0.0, model="b", method=kivi)
    assert b["prefill_tokens_per_s"] == 100.0  # 200 x 0.5, the factor measured on model a
    assert "prefill from runs of the same task times 0.50 (measured on other models)" in b["basis"]
    assert _speed(0.0, model="b", method="paged_eviction")["prefill_tokens_per_s"] == 200.0
    assert _speed(0.0, model="b", method="quest")["prefill_tokens_per_s"] == 200.0  # no factor measured: 1
    assert estimate.method_id("full", "none") == "full" and estimate.method_id("snapkv", "kivi") == "snapkv+kivi"


def test_every_run_gets_an_estimate_from_the_nearest_record(tmp_path, monkeypatch):
    """No decode rate measured for the model: its prefill rate times the decode/prefill ratio of its runs under
    another thread setting; no run of the model at all: the model nearest in weight bytes, scaled by them."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    _record_at(monkeypatch, 0.0, _run(100.0, load_s=2.0), model_bytes=1e8)  # perplexity: prefill only
    _record_at(monkeypatch, 0.0, _run(200.0, task="needle", decode_tokens_per_s=20.0), threads=1)
    _record_at(monkeypatch, 0.0, _run(1e4, task="needle", decode_tokens_per_s=1e2, model="tiny"))  # ratio 0.01
    ruler = _speed(0.0, task="ruler", method="snapkv")
    assert ruler["prefill_tokens_per_s"] == 100.0
    assert ruler["decode_tokens_per_s"] == pytest.approx(10.0)  # this model's ratio 0.1, not the CPU's 0.055
    assert "decode from prefill at this model's decode/prefill ratio 0.100" in ruler["basis"]
    line = estimate.plan_line("ruler", Workload(3, 3000, 300, "x", "y"), ruler)
    assert "about 62 s here (model load 2 s" in line  # 3000 / 100 + 300 / 10 + the load
    big = _speed(0.0, model="big", model_bytes=2e8)
    assert big["prefill_tokens_per_s"] == 50.0 and big["load_s"] == 4.0  # 2x the bytes of m: half the rate
    assert "no run of this model: m's runs, times its size (2.00x)" in big["basis"]
    assert _speed(0.0, model="big") is None  # its size unknown: nothing to scale from
    assert "no speed measured" in estimate.plan_line("ruler", Workload(1, 1, 1, "x", "y"), None)


def test_a_missing_or_nan_figure_neither_crashes_nor_skews_the_estimate(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    nan, inf = float("nan"), float("inf")
    _record_at(monkeypatch, 0.0, _run(nan, decode_tokens_per_s=nan))
    assert not (tmp_path / estimate.SPEED_FILE).exists()  # nothing measured: nothing kept
    _record_at(monkeypatch, nan, _run(100.0, decode_tokens_per_s=inf, load_s=nan, wall_s=nan))
    (run,) = next(iter(json.loads((tmp_path / estimate.SPEED_FILE).read_text()).values()))["runs"]
    assert run["prefill_tokens_per_s"] == 100.0
    assert not {"decode_tokens_per_s", "load_s", "overhead_s", estimate.LOAD_FIELD} & set(run)
    data = json.loads((tmp_path / estimate.SPEED_FILE).read_text())
    (key,) = data
    data[key]["runs"] += [{"prefill_tokens_per_s": "fast"}, {"prefill_tokens_per_s": nan, estimate.LOAD_FIELD: nan},
                          {"prefill_tokens_per_s": -5.0}, "not a run", {"load_s": None}]
    (tmp_path / estimate.SPEED_FILE).write_text(json.dumps(data))  # json writes NaN as NaN
    speed = _speed(0.0)
    assert speed["prefill_tokens_per_s"] == 100.0 and "load_s" not in speed
    assert estimate.estimate_seconds(Workload(1, 100, 0, "x", "y"), speed) == pytest.approx(1.0)
    (tmp_path / estimate.SPEED_FILE).write_text("{not json")
    assert _speed(0.0) is None


def test_a_sweeps_line_is_the_sum_of_its_runs(tmp_path, monkeypatch, capsys):
    """`-m` prints one line before the first run: the sum of its runs' estimates, the model's load counted once
    (the process holds it after the first run); the first run's record keeps it for bench/first_hour.py."""
    from kvbench.run import app
    from kvbench.run.plan import plan_run
    from tests.harness_fakes import compose

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    _record_at(monkeypatch, 0.0, _run(100.0, method="paged_eviction", model="smollm2-135m", load_s=8.0,
                                      logger_start_s=0.5))
    plans = [plan_run(compose([f"results_dir={tmp_path / 'r'}", "method=paged_eviction", f"budget={b}",
                               "task.max_tokens=1024", "logger.wandb=false"])) for b in (256, 512)]
    tokens = [p.task.workload(p.settings).prompt_tokens for p in plans]
    monkeypatch.setattr(estimate, "others_load", lambda: 0.0)
    monkeypatch.setattr(app, "others_load", lambda: 0.0)  # the app's own name for it: no real load is read
    monkeypatch.setattr(app, "_loaded_model", {})  # as in a fresh process: no model held yet
    total = app.announce_sweep(plans)
    assert total == pytest.approx(8.0 + 2 * 0.5 + sum(tokens) / 100.0)
    assert f"kvbench: sweep of 2 run(s): about {estimate.duration(total)} here in all" in capsys.readouterr().out
    kept = estimate.take_sweep_estimate()
    assert kept["sweep_estimate_s"] == round(total, 2) and kept["sweep_announced_after_s"] > 0
    assert estimate.take_sweep_estimate() == {}  # the first run's record alone
    assert estimate.sweep_line([None, None]).endswith("no speed measured on this machine for its model(s) yet")
    assert "(1 of them without one" in estimate.sweep_line([3.0, None])


def _first_hour():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "first_hour.py"
    spec = importlib.util.spec_from_file_location("first_hour", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_hour_sets_each_command_against_what_its_first_line_said(tmp_path):
    """bench/first_hour.py's estimate of a command: a run's age at its line plus its estimate_s; a sweep's age at
    its line plus the sweep's sum; none (so no ratio) where a run printed none or a figure is missing or NaN."""
    bench = _first_hour()

    def runs(*records):
        folder = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        for i, record in enumerate(records):
            (folder / f"run{i}").mkdir(parents=True)
            (folder / f"run{i}" / "metrics.json").write_text(json.dumps(record))
        return str(folder)

    assert bench.command_estimate(runs({"estimate_s": 30.0, "announced_after_s": 5.0})) == 35.0
    sweep = runs({"estimate_s": 20.0, "announced_after_s": 9.0, "sweep_estimate_s": 50.0,
                  "sweep_announced_after_s": 8.0}, {"estimate_s": 5.0, "announced_after_s": 40.0})
    assert bench.command_estimate(sweep) == 58.0  # the sweep's own line, not the runs' later ones
    assert bench.command_estimate(runs({"estimate_s": None, "announced_after_s": 5.0})) is None
    assert bench.command_estimate(runs({"estimate_s": float("nan"), "announced_after_s": 5.0})) is None
    assert bench.command_estimate(runs({"sweep_estimate_s": float("nan")}, {"estimate_s": 3.0})) is None
    assert bench.command_estimate(runs({"estimate_s": 3.0}, {"estimate_s": 3.0})) is None  # a sweep with no line
    assert bench.command_estimate(str(tmp_path / "absent")) is None


def test_first_hour_judges_a_ratio_both_ways_and_a_killed_command_as_unknown():
    judge = _first_hour().judge
    assert judge(60.0, 60.0, killed=False) == (1.0, True)  # identical: within
    assert judge(130.0, 60.0, killed=False) == (2.17, False) and judge(20.0, 60.0, killed=False) == (0.33, False)
    assert judge(60.0, None, killed=False) == (None, False)  # no estimate printed: a failure, never a pass
    assert judge(360.0, 300.0, killed=True) == (1.2, None)  # killed: the time is a lower bound, so unknown
    assert judge(360.0, 100.0, killed=True) == (3.6, False)  # ... unless even the bound is past 2x
    assert judge(360.0, None, killed=True) == (None, None)  # killed before metrics.json kept its estimate


def test_runs_of_a_known_load_come_before_a_narrower_tiers_runs_of_unknown_load(tmp_path, monkeypatch):
    """A record kept before its load was (an older kvbench's: it ran beside 14 busy processes) is used only where
    no run of a known load has the figure at any tier: such a run can be many times slower than the machine now."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    for rate in (300.0, 310.0, 290.0):
        _record_at(monkeypatch, 0.0, _run(rate, task="perplexity"))
    data = json.loads((tmp_path / estimate.SPEED_FILE).read_text())
    (key,) = data
    data[key]["runs"].append({**_run(20.0, task="ruler"), "load_avg_1m": 14.3})  # the old field: unknown load now
    (tmp_path / estimate.SPEED_FILE).write_text(json.dumps(data))
    ruler = _speed(0.0, task="ruler")
    assert ruler["prefill_tokens_per_s"] == 300.0
    assert any(b.startswith("prefill from runs of the same method") for b in ruler["basis"])
    data[key]["runs"] = [r for r in data[key]["runs"] if r.get("task") == "ruler"]  # only the unknown-load run
    (tmp_path / estimate.SPEED_FILE).write_text(json.dumps(data))
    assert _speed(0.0, task="ruler")["prefill_tokens_per_s"] == 20.0  # the last resort
