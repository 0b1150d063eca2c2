"""kvbench-compare, both ways: two independent real runs of one sweep pass (ten times, beside a busy process); an
injected score drop, perplexity rise, null / NaN / inf score, failed run, run whose requests all failed, grown
failed_requests, or corrupt NEW file fails (exit 1) with a line naming it; float noise passes; an empty NEW and
nothing paired are bad input (exit 2); speeds warn unless --gate-speed; runs on one side are listed."""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.reporting import compare
from kvbench.reporting.compare import Limits
from kvbench.console import exit_with
from kvbench.reporting import stats
from kvbench.store.runs import corrupt_runs
from tests import results_fixtures as fx

PPL_NLLS = [3.1, 3.3, 2.9, 3.4, 3.0, 3.2, 3.5, 2.8]
NEEDLE = [1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1]
REPO = pathlib.Path(__file__).resolve().parents[2]


def make_folder(path, *, ppl_shift=0.0, needle_scores=NEEDLE, decode=20.0, peak=1_000_000, extra=False,
                drop_needle=False, commit="c0ffee01", finished_at="2026-11-30T10:00:00+00:00"):
    """Three runs: perplexity (full), perplexity (streaming_llm b256), needle (h2o b256); optional fourth."""
    nlls = [v + ppl_shift for v in PPL_NLLS]
    s = fx.ppl_samples(nlls)
    common = dict(commit=commit, finished_at=finished_at)
    fx.write_run(str(path), fx.config(), {"ppl": fx.ppl_of(s), "prefill_tokens_per_s": 300.0,
                                          "peak_kv_bytes": peak}, s, **common)
    s2 = fx.ppl_samples([v + 0.2 for v in nlls])
    fx.write_run(str(path), fx.config(method="streaming_llm", budget=256, method_options={"sinks": 4}),
                 {"ppl": fx.ppl_of(s2), "prefill_tokens_per_s": 320.0, "peak_kv_bytes": peak // 4}, s2, **common)
    if not drop_needle:
        ns = fx.score_samples(needle_scores)
        fx.write_run(str(path), fx.config(method="h2o", budget=256, task="needle"),
                     {"accuracy": float(np.mean(needle_scores)), "decode_tokens_per_s": decode,
                      "peak_kv_bytes": peak // 4}, ns, **common)
    if extra:
        fx.write_run(str(path), fx.config(method="snapkv", budget=128), {"ppl": 30.0}, fx.ppl_samples([3.4]),
                     **common)


def one_document(path, *, ppl=None, nll=3.2648, samples=True, windows=16, status="ok"):
    """One perplexity run over one document (as the issue's smoke run): ppl, nll, peak_kv_bytes, speeds."""
    s = fx.ppl_samples([nll], tokens=1024, windows=windows) if samples else []
    metrics = {} if status != "ok" else {
        "ppl": math.exp(nll) if ppl is None else ppl, "nll": nll, "peak_kv_bytes": 4_718_592,
        "prefill_tokens_per_s": 194.62}
    return fx.write_run(str(path), fx.config(task_options={"max_tokens": 1025}), metrics, s, status=status)


def throughput_run(path, *, failed=0, status="ok"):
    metrics = {"output_tokens_per_s": 900.0, "failed_requests": failed, "completed_requests": 8 - failed,
               "peak_kv_bytes": 147_456} if status == "ok" else {}
    return fx.write_run(str(path), fx.config(task="throughput", task_options={"num_requests": 8}), metrics, [],
                        status=status)


def _method(label: str) -> str:
    """The method in a run label such as "budget=256, method=h2o, task=needle"."""
    return label.split("method=")[1].split(",")[0].split(" ")[0]


def run_cli(*args):
    """`kvbench-compare ARGS` in this process (the console entry point's code path): returncode, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exit_with(lambda: compare.main([str(a) for a in args]))
        except SystemExit as exc:
            code = exc.code
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def run_cli_process(*args):
    """`python -m kvbench.reporting.compare ARGS` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "kvbench.reporting.compare", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=str(REPO))


def verdict_of(base, new, **kw):
    return compare.compare(compare.select_runs(str(base)), compare.select_runs(str(new)), Limits(**kw))


def regression_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("- REGRESSION: ")]


# --------------------------------------------------------------------------- real runs, twice
SWEEP = [["method=full"], ["method=streaming_llm", "budget=64"],
         ["task=throughput", "method=full", "task.num_requests=4", "task.input_tokens=[40,80]",
          "task.output_tokens=[3,6]"]]
PPL_OPTIONS = ["task.max_tokens=256", "task.chunk_size=64", "task.num_documents=2"]


def run_sweep(folder: pathlib.Path, extra: tuple = ()) -> list[dict]:
    """The sweep SWEEP through app.run (the CLI's path after Hydra composed the config) on the tiny model."""
    from kvbench.run import app
    from tests.fixtures.task_fixtures import run_cfg, tiny_loader

    records = []
    for overrides in SWEEP:
        opts = [] if "task=throughput" in overrides else PPL_OPTIONS
        cfg = run_cfg(folder, overrides + opts + list(extra))
        records.append(app.run(cfg, load_model_fn=tiny_loader(), print_summary=False))
    return records


@pytest.fixture
def one_thread():
    from tests.fixtures.task_fixtures import one_thread as gen

    yield from gen()


@pytest.mark.parametrize("repeats", [2, pytest.param(10, marks=pytest.mark.slow)])
def test_two_real_runs_of_one_sweep_pass_repeatedly_beside_a_busy_process(tmp_path, one_thread, repeats):
    """BASE and `repeats` NEW sweeps, each run from scratch at this commit while another process spins on a core:
    every compare exits 0 (speeds move, they only warn); the perplexity samples carry windows that add up."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        t0 = time.process_time()
        base = run_sweep(tmp_path / "base")
        assert [r["status"] for r in base] == ["ok"] * 3, [r["error"] for r in base]
        for i in range(repeats):
            new = run_sweep(tmp_path / f"new{i}")
            assert [r["status"] for r in new] == ["ok"] * 3
            assert compare.main([str(tmp_path / "base" / "results"), str(tmp_path / f"new{i}" / "results"),
                                 "--json", str(tmp_path / f"v{i}.json")]) == 0
        assert busy.poll() is None  # it competed the whole time
        assert time.process_time() - t0 < 60
    finally:
        busy.kill()
        busy.wait()
    v = json.loads((tmp_path / f"v{repeats - 1}.json").read_text())
    assert v["ok"] and v["pairs"] == 3 and not v["only_base"] and not v["only_new"]
    compared = {(r["run"].split("task=")[1], r["metric"]) for r in v["rows"]}
    assert {("perplexity", "ppl"), ("perplexity", "nll"), ("perplexity", "peak_kv_bytes"),
            ("throughput", "failed_requests"), ("throughput", "output_tokens_per_s")} <= compared
    ppl_rows = [r for r in v["rows"] if r["metric"] == "ppl"]
    # same items in both runs (2 documents x 4 windows of 64 tokens): the paired interval, or the relative floor
    # when the runs agree to the last bit
    assert all(r["verdict"] == "ok" and r["source"] in ("relative 0.0001", "paired bootstrap 95% over 8 windows")
               for r in ppl_rows), ppl_rows
    for r in (r for r in v["rows"] if r["kind"] == "speed"):
        assert r["verdict"] in ("ok", "better", "warning") and r["source"].endswith("(not gated: a warning)")
    # the perplexity samples: windows of 64 predicted tokens that add up to the document
    run_dir = next(p for p in (tmp_path / "base" / "results").iterdir() if "perplexity_full" in p.name)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        assert s["window_tokens"] == [64, 64, 64, 63] and sum(s["window_tokens"]) == s["num_tokens"]
        assert sum(s["window_nll_sum"]) == pytest.approx(s["nll"] * s["num_tokens"], rel=1e-9)
    # the CLI, once: same verdict, exit 0
    proc = run_cli_process(tmp_path / "base" / "results", tmp_path / "new0" / "results")
    assert proc.returncode == 0 and "3 paired runs, 0 missing in NEW, 0 regressions" in proc.stdout, proc.stdout + proc.stderr


def test_a_throughput_run_whose_requests_all_fail_is_a_failed_run_and_a_regression(tmp_path, one_thread,
                                                                                    monkeypatch):
    """NEW code in which no request fits the pool: tasks/throughput.py records status "failed" (with the first
    request's error), and the compare fails naming the run."""
    from kvbench.runtime.cache.kv_cache import PagedKVCache

    run_sweep(tmp_path / "base")
    monkeypatch.setattr(PagedKVCache, "capacity_blocks", lambda self: 0)
    new = run_sweep(tmp_path / "new")
    assert [r["status"] for r in new] == ["ok", "ok", "failed"]
    assert new[2]["error"].startswith("RuntimeError: all 4 requests failed: request 0 does not fit")
    proc = run_cli(tmp_path / "base" / "results", tmp_path / "new" / "results")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = regression_lines(proc.stdout)
    assert "task=throughput" in line and "all 4 requests failed" in line


# --------------------------------------------------------------------------- injected cases
def test_identical_folders_pass(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["ok"] and v["pairs"] == 3 and not v["only_base"] and not v["only_new"]
    metrics = {(_method(r["run"]), r["metric"]) for r in v["rows"]}
    assert {("full", "ppl"), ("h2o", "accuracy"), ("h2o", "decode_tokens_per_s"), ("full", "peak_kv_bytes")} <= metrics


def test_injected_accuracy_drop_fails_with_exit_1(tmp_path):
    make_folder(tmp_path / "a")
    dropped = [0] * 8 + NEEDLE[8:]  # accuracy 0.8 -> 0.5: far outside the bootstrap interval
    make_folder(tmp_path / "b", needle_scores=dropped)
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--json", tmp_path / "v.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "| accuracy |" in proc.stdout and "REGRESSION" in proc.stdout
    (line,) = regression_lines(proc.stdout)
    assert "method=h2o" in line and "accuracy 0.8 -> 0.5 (-0.3 (-37.50%); 95% interval [-0.5, -0.1], paired " \
                                    "bootstrap 95% over 20 samples; min effect 0.008)" in line
    data = json.loads((tmp_path / "v.json").read_text())
    regs = [(r["metric"], r["base"], r["new"]) for r in data["regressions"]]
    assert regs == [("accuracy", pytest.approx(np.mean(NEEDLE)), pytest.approx(np.mean(dropped)))]
    assert data["regressions"][0]["source"] == "paired bootstrap 95% over 20 samples"


def test_small_drop_inside_the_bootstrap_interval_is_inconclusive_but_a_regression_without_samples(tmp_path):
    make_folder(tmp_path / "a")
    one_less = list(NEEDLE)
    one_less[0] = 0  # 0.80 -> 0.75: inside the 95% interval of 20 samples, which also holds a 1% drop
    make_folder(tmp_path / "b", needle_scores=one_less)
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    acc = [r for r in v["rows"] if r["metric"] == "accuracy"][0]
    assert not v["ok"] and v["gate"] == "inconclusive" and acc["verdict"] == "inconclusive", acc
    assert acc["interval"][0] < -0.008 and acc["interval"][1] >= 0 and not v["regressions"]
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 3 and "**INCONCLUSIVE**" in proc.stdout and "PASS" not in proc.stdout
    assert "- INCONCLUSIVE: budget=256, method=h2o, task=needle: accuracy 0.8 -> 0.75" in proc.stdout
    assert verdict_of(tmp_path / "a", tmp_path / "b", min_effect=0.5)["ok"]  # only a 50% drop matters: ruled out
    # without samples.jsonl the tolerance is 1e-4 relative: the same drop is a regression, unless --max-drop
    for run in os.listdir(tmp_path / "a"):
        if "needle" in run:
            os.unlink(tmp_path / "a" / run / "samples.jsonl")
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert not v["ok"] and [(r["metric"], r["source"]) for r in v["regressions"]] == [("accuracy", "relative 0.0001")]
    assert verdict_of(tmp_path / "a", tmp_path / "b", max_drop=0.1)["ok"]


@pytest.mark.parametrize("samples", [True, False], ids=["windows", "no-samples"])
def test_one_document_perplexity_float_noise_passes_and_1_5x_fails(tmp_path, samples):
    """The issue's case: one document, ppl 26.17 moved by 1e-7 relative (float noise) -> exit 0 (the 1e-4 relative
    tolerance); 1.5x -> exit 1, with the paired bootstrap over the document's windows, or the relative tolerance
    without samples."""
    one_document(tmp_path / "a", samples=samples)
    one_document(tmp_path / "noise", nll=3.2648 + 1e-7, samples=samples)  # every window's nll + 1e-7: ppl x(1+1e-7)
    proc = run_cli(tmp_path / "a", tmp_path / "noise")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    noise_source = "paired bootstrap 95% over 16 windows" if samples else "relative 0.0001"
    assert f"| ppl | 26.175 | 26.175 | +2.617e-06 (+1.0e-05%) | [-0.002615, +0.00262] | 0.26175 | {noise_source} " \
           "| ok |" in proc.stdout, proc.stdout
    one_document(tmp_path / "worse", nll=3.2648 + math.log(1.5), samples=samples)
    proc = run_cli(tmp_path / "a", tmp_path / "worse")
    assert proc.returncode == 1, proc.stdout
    source = "paired bootstrap 95% over 16 windows" if samples else "relative 0.0001"
    lines = regression_lines(proc.stdout)
    assert any("ppl 26.175 -> 39.262 (+13.09 (+50.00%)" in line and source in line for line in lines), lines


def test_paired_bootstrap_finds_a_shift_on_every_window_that_bases_own_interval_hides(tmp_path):
    """One document of 16 windows whose NLLs differ widely (+-1.0): its ppl has a wide interval of its own (about
    +-60%), yet NEW worse by 10% on every window is a regression when NEW's windows are paired with BASE's. NEW
    worse on average by 5%, but worse on half the windows and better on the others, is not."""
    s = fx.ppl_samples([3.0], tokens=1024, windows=16, spread=1.0)
    cfg = fx.config(task_options={"max_tokens": 1025})
    fx.write_run(str(tmp_path / "a"), cfg, {"ppl": fx.ppl_of(s)}, s)
    worse = fx.ppl_samples([3.0 + math.log(1.1)], tokens=1024, windows=16, spread=1.0)
    fx.write_run(str(tmp_path / "b"), cfg, {"ppl": fx.ppl_of(worse)}, worse)
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    (row,) = v["regressions"]
    assert row["change_pct"] == pytest.approx(10.0) and row["source"] == "paired bootstrap 95% over 16 windows"
    fx.write_run(str(tmp_path / "c"), cfg, {"ppl": fx.ppl_of(worse)}, [])  # NEW without samples: no wider tolerance
    v = verdict_of(tmp_path / "a", tmp_path / "c")
    samples, row = v["rows"]
    assert samples["verdict"] == "regression" and samples["note"].startswith("samples missing in NEW")
    assert row["verdict"] == "regression" and row["source"] == "relative 0.0001 (samples missing in NEW)"
    mixed = fx.ppl_samples([3.0], tokens=1024, windows=16, spread=1.0)  # nll +0.3 on 8 windows, -0.2 on 8
    mixed[0]["window_nll_sum"] = [v + 64 * (0.3 if i % 4 < 2 else -0.2)
                                  for i, v in enumerate(mixed[0]["window_nll_sum"])]
    ppl = math.exp(sum(mixed[0]["window_nll_sum"]) / 1024)
    fx.write_run(str(tmp_path / "d"), cfg, {"ppl": ppl}, mixed)
    v = verdict_of(tmp_path / "a", tmp_path / "d")
    (row,) = v["rows"]
    # the interval holds both no change and a 1% rise: inconclusive (issue 56: never PASS on what it cannot tell)
    assert v["gate"] == "inconclusive" and row["verdict"] == "inconclusive"
    assert row["change_pct"] == pytest.approx(100 * (math.exp(0.05) - 1))
    assert row["source"] == "paired bootstrap 95% over 16 windows" and row["tolerance"] > row["change"]
    assert row["interval"][0] <= 0 and row["interval"][1] >= row["min_effect"]


def test_perplexity_rise_is_a_regression_and_fall_is_not(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", ppl_shift=math.log(1.5))  # every document's nll + log 1.5: ppl x1.5
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    regs = sorted((_method(r["run"]), r["metric"]) for r in v["regressions"])
    assert regs == [("full", "ppl"), ("streaming_llm", "ppl")]
    assert all(r["change_pct"] == pytest.approx(50.0) for r in v["regressions"])
    assert verdict_of(tmp_path / "b", tmp_path / "a")["ok"]  # lower perplexity is better, not a regression


@pytest.mark.parametrize("how,shown", [("null", "null"), ("missing", "missing"), ("nan", "NaN"), ("inf", "inf")])
def test_a_score_lost_in_new_is_a_regression(tmp_path, how, shown):
    """ppl, nll and peak_kv_bytes null / absent / NaN / inf in NEW where BASE had numbers: each one named."""
    one_document(tmp_path / "a")
    value = {"null": None, "nan": float("nan"), "inf": float("inf")}.get(how)
    s = fx.ppl_samples([3.2648], tokens=1024, windows=16)
    metrics = {"prefill_tokens_per_s": 190.0}
    if how != "missing":
        metrics.update(ppl=value, nll=value, peak_kv_bytes=value)
    rec = fx.write_run(str(tmp_path / "b"), fx.config(task_options={"max_tokens": 1025}), metrics, s)
    if how in ("nan", "inf"):  # the results writer stores null and names the non-finite values
        assert rec["nonfinite_metrics"] == {"ppl": how, "nll": how, "peak_kv_bytes": how}
        stored = json.loads(open(os.path.join(rec["run_dir"], "metrics.json")).read())
        assert stored["ppl"] is None and stored["nonfinite_metrics"]["ppl"] == how
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = regression_lines(proc.stdout)
    peak = "null" if how == "missing" else shown  # a required field: written as null when the run lacks it
    assert sorted(line.split(": ")[-1] for line in lines) == [
        f"nll is {shown} in NEW", f"peak_kv_bytes is {peak} in NEW", f"ppl is {shown} in NEW"]


def test_failed_run_in_new_is_a_regression(tmp_path):
    one_document(tmp_path / "a")
    one_document(tmp_path / "b", status="failed")
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1
    (line,) = regression_lines(proc.stdout)
    assert "failed in NEW: RuntimeError: boom" in line
    # a failed run that only NEW has is a regression too (and is still listed as only in NEW)
    one_document(tmp_path / "c")
    throughput_run(tmp_path / "c", status="failed")
    v = verdict_of(tmp_path / "a", tmp_path / "c")
    assert [r["metric"] for r in v["regressions"]] == ["status"] and len(v["only_new"]) == 1


def test_grown_failed_requests_is_a_regression(tmp_path):
    throughput_run(tmp_path / "a")
    throughput_run(tmp_path / "b", failed=2)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1
    (line,) = regression_lines(proc.stdout)
    assert "failed_requests 0 -> 2" in line and "must not grow" in line
    assert run_cli(tmp_path / "b", tmp_path / "a").returncode == 0  # fewer failures: better


@pytest.mark.parametrize("file,data,reason", [
    ("metrics.json", b'{"run_id": "x", "status": "ok", "ppl": 26.1', "metrics.json is not valid JSON (truncated?)"),
    ("metrics.json", b'{"run_id": "x", "status": "ok", "note": "\xff\xfe"}', "metrics.json is not valid UTF-8"),
    ("metrics.json", b'[1, 2]', "metrics.json holds a list, not a mapping"),
    ("config.yaml", b"model: {name: [unclosed\n", "config.yaml is not valid YAML"),
    ("config.yaml", b"- just\n- a list\n", "config.yaml holds a list, not a mapping"),
    ("config.yaml", b"model:\n  name: \xff\n", "config.yaml is not valid UTF-8"),
])
def test_corrupt_new_files_are_regressions_named_with_their_folder(tmp_path, file, data, reason):
    one_document(tmp_path / "a")
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    rec = one_document(tmp_path / "b")
    (pathlib.Path(rec["run_dir"]) / file).write_bytes(data)
    assert [(n, r[:len(reason)]) for n, r in corrupt_runs(str(tmp_path / "b"))] == [(rec["run_id"], reason)]
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--json", tmp_path / "v.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = regression_lines(proc.stdout)
    assert line.startswith(f"- REGRESSION: NEW run folder {rec['run_id']}: {reason}")
    v = json.loads((tmp_path / "v.json").read_text())
    assert not v["only_new"] and v["corrupt_new"][0][0] == rec["run_id"]
    assert v["pairs"] == 3 and len(v["only_base"]) == 1  # the corrupt run is not compared, its BASE run is listed
    # BASE's corrupt folders fail the gate too: their settings would go ungated (issue 56)
    proc = run_cli(tmp_path / "b", tmp_path / "a")
    assert proc.returncode == 1, proc.stdout
    (line,) = regression_lines(proc.stdout)
    assert line.startswith(f"- REGRESSION: BASE run folder {rec['run_id']}: BASE run folder {rec['run_id']} "
                           f"cannot be read ({reason}") and "its setting is not gated" in line


def test_empty_or_missing_new_and_nothing_paired_are_exit_2_one_line(tmp_path):
    make_folder(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    for new, words in ((tmp_path / "empty", "no runs in NEW"), (tmp_path / "nope", "no results folder")):
        proc = run_cli(tmp_path / "a", new)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc
        assert words in proc.stderr and str(new) in proc.stderr and "PASS" not in proc.stderr
    make_folder(tmp_path / "c")
    for run in os.listdir(tmp_path / "c"):  # one setting changed: no run of NEW pairs with one of BASE
        path = tmp_path / "c" / run / "config.yaml"
        if path.is_file():
            path.write_text(path.read_text().replace("block_size: 16", "block_size: 32"))
    proc = run_cli(tmp_path / "a", tmp_path / "c")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc
    assert "nothing paired" in proc.stderr and "runtime.block_size 16 vs 32" in proc.stderr


def test_speeds_warn_by_default_and_gate_when_asked(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", decode=8.0)  # -60% decode tok/s
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0 and "0 regressions, 0 inconclusive, 1 warnings: **PASS**" in proc.stdout, proc.stdout
    assert "- warning: budget=256, method=h2o, task=needle: decode_tokens_per_s 20 -> 8 (-60.00%, 60% slower; " \
           "limit 50% slowdown)" in proc.stdout
    assert "| decode_tokens_per_s | 20 | 8 | -60.00% | 50% slowdown |" in proc.stdout
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--gate-speed")
    assert proc.returncode == 1 and "decode_tokens_per_s" in regression_lines(proc.stdout)[0]
    make_folder(tmp_path / "c", decode=17.0)  # -15%: inside the default 50%, outside 10%
    assert verdict_of(tmp_path / "a", tmp_path / "c", gate_speed=True)["ok"]
    v = verdict_of(tmp_path / "a", tmp_path / "c", gate_speed=True, max_slowdown=0.1)
    assert [r["metric"] for r in v["regressions"]] == ["decode_tokens_per_s"]
    assert stats.speed_loss("ttft_s", 0.1, 0.2) == pytest.approx(0.5)  # twice the latency = half the speed
    assert stats.speed_loss("decode_tokens_per_s", 20.0, 10.0) == pytest.approx(0.5)
    make_folder(tmp_path / "d", peak=1_000_016)
    assert {r["metric"] for r in verdict_of(tmp_path / "a", tmp_path / "d")["regressions"]} == {"peak_kv_bytes"}
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--max-slowdown", "1.5")
    assert proc.returncode == 2 and "--max-slowdown=1.5" in proc.stderr


def test_markdown_lists_every_metric_compared_per_run(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    out = proc.stdout
    for run in ("budget=none, method=full, task=perplexity", "budget=256, method=h2o, task=needle"):
        assert f"### {run}" in out
    full = out.split("### budget=none, method=full, task=perplexity")[1].split("###")[0]
    assert [line.split(" | ")[0] for line in full.splitlines() if line.startswith("| ") and "---" not in line] == [
        "| metric", "| ppl", "| peak_kv_bytes", "| prefill_tokens_per_s"]


def test_runs_on_one_side_are_listed_and_missing_in_new_fails_unless_allowed(tmp_path):
    make_folder(tmp_path / "a", extra=True)
    make_folder(tmp_path / "b", drop_needle=True)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a crashed sweep never passes
    assert "2 paired runs, 2 missing in NEW, 2 regressions, 0 inconclusive, 0 warnings: **FAIL**" in proc.stdout
    assert sorted(_method(line) for line in regression_lines(proc.stdout)) == ["h2o", "snapkv"]
    assert all("missing in NEW (BASE folder " in line for line in regression_lines(proc.stdout))
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--allow-missing")  # a deliberate subset: listed, counted
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 paired runs, 2 missing in NEW (allowed), 0 regressions, 0 inconclusive, 0 warnings: **PASS**" in proc.stdout
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["pairs"] == 2 and v["missing"] == 2 and not v["only_new"]
    assert sorted(_method(name) for name in v["only_base"]) == ["h2o", "snapkv"]
    assert "Only in" in proc.stdout and "h2o" in proc.stdout.split("Only in")[1]
    assert run_cli(tmp_path / "b", tmp_path / "a").returncode == 0  # a run only NEW has is listed, not a regression


def _incomplete(path, how):
    """NEW as a copy of an identical rerun with one thing broken, as the issue found them passing."""
    folders = sorted(p for p in path.iterdir() if p.is_dir() and "needle" in p.name)
    run = folders[0]
    if how == "folder deleted":
        shutil.rmtree(run)
    elif how == "metrics.json deleted":
        (run / "metrics.json").unlink()
    else:  # the config no longer pairs with BASE's (seed 1, or budget 256 -> 64)
        old, new = {"seed changed": ("seed: 0", "seed: 1"), "budget changed": ("budget: 256", "budget: 64")}[how]
        text = (run / "config.yaml").read_text()
        assert old in text
        (run / "config.yaml").write_text(text.replace(old, new))


@pytest.mark.parametrize("how", ["folder deleted", "metrics.json deleted", "seed changed", "budget changed"])
def test_an_incomplete_new_fails_and_the_complete_rerun_passes(tmp_path, how):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    assert run_cli(tmp_path / "a", tmp_path / "b").returncode == 0
    _incomplete(tmp_path / "b", how)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 paired runs, 1 missing in NEW, 1 regressions" in proc.stdout
    (line,) = regression_lines(proc.stdout)
    assert "method=h2o" in line and "missing in NEW" in line
    assert run_cli(tmp_path / "a", tmp_path / "b", "--allow-missing").returncode == 0


@pytest.mark.parametrize("how", ["deleted", "empty", "truncated"])
def test_samples_missing_in_new_are_a_regression_never_a_wider_tolerance(tmp_path, how):
    """NEW's perplexity x1.5 with its samples.jsonl deleted or empty passed before (the tolerance fell back to
    BASE's own interval, +-20 ppl); now the lost samples fail, and so does the ppl on the relative floor."""
    s = fx.ppl_samples(PPL_NLLS, windows=4, spread=2.0)  # widely spread windows: BASE's own interval is wide
    cfg = fx.config()
    fx.write_run(str(tmp_path / "a"), cfg, {"ppl": fx.ppl_of(s)}, s)
    worse = fx.ppl_samples([v + math.log(1.5) for v in PPL_NLLS], windows=4, spread=2.0)
    rec = fx.write_run(str(tmp_path / "b"), cfg, {"ppl": fx.ppl_of(worse)}, worse)
    path = pathlib.Path(rec["run_dir"]) / "samples.jsonl"
    if how == "deleted":
        path.unlink()
    elif how == "empty":
        path.write_text("")
    else:
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:3]))
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout
    lines = regression_lines(proc.stdout)
    what = {"deleted": "samples.jsonl is missing", "empty": "samples.jsonl is empty", "truncated": "3 of 8 samples"}
    assert any(f"samples missing in NEW: {what[how]} (BASE has 8)" in line for line in lines), lines
    assert any("ppl" in line and "+50.00%" in line for line in lines), lines
    # the same NEW with its samples: the paired interval finds the x1.5 too; identical samples pass
    fx.write_run(str(tmp_path / "c"), cfg, {"ppl": fx.ppl_of(worse)}, worse)
    assert [r["metric"] for r in verdict_of(tmp_path / "a", tmp_path / "c")["regressions"]] == ["ppl"]
    fx.write_run(str(tmp_path / "d"), cfg, {"ppl": fx.ppl_of(s)}, s)
    assert verdict_of(tmp_path / "a", tmp_path / "d")["ok"]


def _second_attempt(folder: pathlib.Path, name: str, status: str, finished_at: str) -> None:
    """A copy of a run folder under another name (the same config): a second attempt of one setting."""
    copy = shutil.copytree(folder, folder.parent / name)
    metrics = json.loads((copy / "metrics.json").read_text())
    metrics.update(run_id=name, run_dir=str(copy), status=status, finished_at=finished_at,
                   error=None if status == "ok" else "RuntimeError: second attempt died")
    (copy / "metrics.json").write_text(json.dumps(metrics))


@pytest.mark.parametrize("newest", ["failed", "ok"])
def test_the_newest_of_two_new_attempts_decides(tmp_path, newest):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    needle = next(p for p in (tmp_path / "b").iterdir() if "needle" in p.name)
    if newest == "failed":  # the failed attempt is newer (and sorts first by name): it decides
        _second_attempt(needle, "0_retry", "failed", "2026-11-30T12:00:00+00:00")
    else:  # a failed older attempt beside the good newer one: the good one decides
        _second_attempt(needle, "zz_retry", "failed", "2026-11-30T09:00:00+00:00")
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    if newest == "ok":
        assert proc.returncode == 0, proc.stdout
        return
    assert proc.returncode == 1, proc.stdout
    (line,) = regression_lines(proc.stdout)
    assert "method=h2o" in line and "failed in NEW: RuntimeError: second attempt died" in line
    assert f"the newest of 2 attempts of this setting; older: {needle.name} ok" in line


def test_two_commits_in_one_folder(tmp_path):
    make_folder(tmp_path / "r", commit="aaaa1111", finished_at="2026-11-30T10:00:00+00:00")
    make_folder(tmp_path / "r", commit="bbbb2222", ppl_shift=0.5, finished_at="2026-11-30T11:00:00+00:00")
    proc = run_cli(tmp_path / "r", "--base-commit", "aaaa", "--new-commit", "bbbb")
    assert proc.returncode == 1 and "| ppl |" in proc.stdout, proc.stdout + proc.stderr
    v = compare.compare(compare.select_runs(str(tmp_path / "r"), "aaaa"), compare.select_runs(str(tmp_path / "r"), "bbbb"))
    assert v["pairs"] == 3 and sorted(r["metric"] for r in v["regressions"]) == ["ppl", "ppl"]
    proc = run_cli(tmp_path / "r", "--base-commit", "zzzz", "--new-commit", "bbbb")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "aaaa1111" in proc.stderr, proc.stderr


def test_pairing_ignores_the_code_version_but_not_the_setting(tmp_path):
    make_folder(tmp_path / "a", commit="aaaa1111")
    make_folder(tmp_path / "b", commit="bbbb2222")
    base, new = compare.select_runs(str(tmp_path / "a")), compare.select_runs(str(tmp_path / "b"))
    assert set(base) == set(new) and len(base) == 3


def test_bad_input_is_one_line_exit_2(tmp_path):
    proc = run_cli_process(tmp_path / "nope", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(tmp_path / "nope") in proc.stderr
    proc = run_cli(tmp_path, tmp_path, "--rel-tol", "nan")
    assert proc.returncode == 2 and "--rel-tol=nan" in proc.stderr and proc.stderr.count("\n") == 1


def test_bootstrap_statistics_reproduce_the_recorded_metrics():
    s = fx.ppl_samples(PPL_NLLS)
    fn = stats.statistic("ppl", s, fx.ppl_of(s))
    assert fn(np.arange(len(s))) == pytest.approx(fx.ppl_of(s))
    lo, hi = stats.bootstrap_interval(fn, len(s))
    assert lo < fx.ppl_of(s) < hi and hi / lo < 1.5
    # with windows: one document has an interval, over its windows
    one = fx.ppl_samples([3.0], tokens=1024, windows=16)
    assert stats.sample_count("ppl", one) == 16 and stats.sample_unit("ppl", one) == "windows"
    fn = stats.statistic("ppl", one, math.exp(3.0))
    assert fn(np.arange(16)) == pytest.approx(math.exp(3.0))
    lo, hi = stats.bootstrap_interval(fn, 16)
    assert lo < math.exp(3.0) < hi and hi / lo < 1.5
    assert stats.sample_count("ppl", fx.ppl_samples([3.0])) == 1  # no windows: one document, no interval
    lb = fx.score_samples([1, 0, 1, 1], "qasper") + fx.score_samples([0.5, 0.5], "trec")
    fn = stats.statistic("score", lb, 100 * (0.75 + 0.5) / 2)  # LongBench: mean over datasets, x100
    assert fn(np.arange(6)) == pytest.approx(62.5)
    fn = stats.statistic("score_trec", lb, 50.0)
    assert fn(np.arange(2)) == pytest.approx(50.0)
    assert stats.lower_is_better("ppl") and not stats.lower_is_better("accuracy")
    assert stats.is_score("score_qasper") and stats.is_score("arc_easy/acc,none") and not stats.is_score("acc_1024_50")
    assert stats.is_speed("tpot_s_p99") and stats.is_speed("prefill_tokens_per_s") and not stats.is_speed("ppl")
    assert math.isfinite(stats.bootstrap_interval(lambda idx: 1.0, 1)[0])


def test_a_setting_added_by_a_newer_version_still_pairs(tmp_path):
    """NEW's configs carry a runtime key BASE's lack (a newer version, default value): runs still pair on the keys
    both know, the key is listed, and a regression is still found."""
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", ppl_shift=0.5)
    for run in os.listdir(tmp_path / "b"):
        path = tmp_path / "b" / run / "config.yaml"
        if path.is_file():
            path.write_text(path.read_text().replace("runtime:\n", "runtime:\n  max_num_seqs: 256\n"))
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["pairs"] == 3 and v["ignored_keys"] == ["runtime.max_num_seqs"]
    assert sorted(r["metric"] for r in v["regressions"]) == ["ppl", "ppl"]
    assert "runtime.max_num_seqs" in compare.to_markdown(v, "a", "b")


def test_report_counts_and_names_corrupt_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from kvbench.reporting import report

    make_folder(tmp_path / "r")
    bad = one_document(tmp_path / "r")
    (pathlib.Path(bad["run_dir"]) / "metrics.json").write_bytes(b'{"run_id": "x", "ppl": 2')
    other = shutil.copytree(bad["run_dir"], tmp_path / "r" / "copied_run")
    (other / "metrics.json").write_text(json.dumps({"run_id": "copied_run", "status": "ok"}))
    (other / "config.yaml").write_bytes(b"\xff\xfe")
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "r")], capture_output=True,
                          text=True, timeout=300, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    assert line.startswith("kvbench-report: 2 corrupt run folder(s): ")
    assert f"{bad['run_id']} (metrics.json is not valid JSON (truncated?)" in line and "left out" in line
    assert "copied_run (config.yaml is not valid UTF-8: left out)" in line


def ruler_run(path, tasks, score):
    """A RULER run whose `score` averages `tasks` (qa_1 / qa_2 absent without their data)."""
    metrics = {"score": score, "score_tasks": ",".join(tasks), **{f"score_{t}": score for t in tasks},
               **{f"num_samples_{t}": 1 for t in tasks}}
    samples = [s for t in tasks for s in fx.score_samples([score / 100], t)]
    fx.write_run(str(path), fx.config(task="ruler", task_options={"tasks": ["all"], "lengths": [1024]}), metrics,
                 samples)


ALL13 = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
         "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]


def test_an_11_task_score_is_never_paired_with_a_13_task_one(tmp_path):
    ruler_run(tmp_path / "a", ALL13, 60.0)
    ruler_run(tmp_path / "b", ALL13[:11], 60.0)  # NEW without the QA data: the same per-task scores
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout
    lines = regression_lines(proc.stdout)
    assert any("score averages 11 tasks in NEW, 13 in BASE: not compared (qa_1, qa_2 missing in NEW)" in line
               for line in lines), lines
    # NEW that averages more tasks than BASE: not compared either, a warning (nothing BASE had is lost)
    v = verdict_of(tmp_path / "b", tmp_path / "a")
    (row,) = [r for r in v["rows"] if r["metric"] == "score"]
    assert v["ok"] and row["verdict"] == "warning" and row["note"].startswith("score averages 13 tasks in NEW, 11")
    ruler_run(tmp_path / "c", ALL13, 60.0)  # the same tasks: compared as before
    (row,) = [r for r in verdict_of(tmp_path / "a", tmp_path / "c")["rows"] if r["metric"] == "score"]
    assert row["verdict"] == "ok" and row["note"] == ""


# --------------------------------------------------------------------------- issue 68: cases that passed in silence
def _one_document_with(path, **metrics):
    s = fx.ppl_samples([3.2648], tokens=1024, windows=16)
    base = {"ppl": math.exp(3.2648), "nll": 3.2648, "peak_kv_bytes": 4_718_592, "prefill_tokens_per_s": 194.62}
    return fx.write_run(str(path), fx.config(task_options={"max_tokens": 1025}), {**base, **metrics}, s)


def test_a_data_revision_on_one_side_only_is_inconclusive_and_says_why(tmp_path):
    """NEW read hub data at a recorded revision that BASE does not record: paired on the shared keys, but never a
    PASS (the data may differ); the same revision on both sides passes."""
    _one_document_with(tmp_path / "a")
    _one_document_with(tmp_path / "b", data_revision=f"THUDM/LongBench@{'a' * 40}")
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == compare.EXIT_INCONCLUSIVE, proc.stdout
    assert "INCONCLUSIVE" in proc.stdout and "data_revision in NEW only" in proc.stdout
    assert run_cli(tmp_path / "b", tmp_path / "a").returncode == compare.EXIT_INCONCLUSIVE  # BASE only: the same
    _one_document_with(tmp_path / "c", data_revision=f"THUDM/LongBench@{'a' * 40}")
    assert run_cli(tmp_path / "b", tmp_path / "c").returncode == compare.EXIT_PASS


@pytest.mark.parametrize("base_value", [None, float("nan")])
def test_a_score_base_has_no_number_for_is_inconclusive_never_left_out(tmp_path, base_value):
    """BASE's ppl null (or NaN) and NEW's 1e6: not left out of the gate (it passed before); both null: nothing to
    judge, the pair passes."""
    _one_document_with(tmp_path / "a", ppl=base_value, nll=base_value)
    _one_document_with(tmp_path / "b", ppl=1e6, nll=math.log(1e6))
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == compare.EXIT_INCONCLUSIVE, proc.stdout
    shown = "null" if base_value is None else "NaN"
    assert f"ppl is {shown} in BASE and 1,000,000 in NEW" in proc.stdout
    _one_document_with(tmp_path / "c", ppl=base_value, nll=base_value)
    assert run_cli(tmp_path / "a", tmp_path / "c").returncode == compare.EXIT_PASS


def test_a_config_key_holding_html_is_escaped_in_the_paired_without_line(tmp_path):
    _one_document_with(tmp_path / "a")
    s = fx.ppl_samples([3.2648], tokens=1024, windows=16)
    fx.write_run(str(tmp_path / "b"), fx.config(task_options={"max_tokens": 1025, "<img src=x onerror=alert(1)>": 1}),
                 {"ppl": math.exp(3.2648), "nll": 3.2648, "peak_kv_bytes": 4_718_592, "prefill_tokens_per_s": 194.62},
                 s)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("Paired without"))
    assert "\\<img src=x onerror=alert(1)\\>" in line and not re.search(r"(?<!\\)[<>]", line)  # no raw tag


def test_json_naming_a_folder_is_one_line_before_anything_is_printed(tmp_path):
    make_folder(tmp_path / "a")
    for bad, needle in ((tmp_path, "is a folder"), (tmp_path / "nope" / "v.json", "no folder")):
        proc = run_cli(tmp_path / "a", tmp_path / "a", "--json", bad)
        assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
        assert needle in proc.stderr and proc.stderr.count("\n") == 1
    proc = run_cli_process(tmp_path / "a", tmp_path / "a", "--json", tmp_path)
    assert proc.returncode == 2 and "PASS" not in proc.stdout and "Traceback" not in proc.stderr
