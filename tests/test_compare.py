"""kvbench-compare on hand-made results folders: identical folders pass; an injected accuracy drop, perplexity rise,
slowdown or KV growth fails (exit 1); noise inside the bootstrap interval passes; runs on one side are listed."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from kvbench import compare
from kvbench.reporting import stats
from tests import results_fixtures as fx

PPL_NLLS = [3.1, 3.3, 2.9, 3.4, 3.0, 3.2, 3.5, 2.8]
NEEDLE = [1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1]


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


def _method(label: str) -> str:
    """The method in a run label such as "budget=256, method=h2o, task=needle"."""
    return label.split("method=")[1].split(",")[0].split(" ")[0]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvbench.compare", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def verdict_of(base, new, **kw):
    return compare.compare(compare.select_runs(str(base)), compare.select_runs(str(new)), **kw)


def test_identical_folders_pass(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b")
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["ok"] and v["pairs"] == 3 and not v["only_base"] and not v["only_new"]
    metrics = {(_method(r["run"]), r["metric"]) for r in v["rows"]}
    assert {("full", "ppl"), ("h2o", "accuracy"), ("h2o", "decode_tokens_per_s"), ("full", "peak_kv_bytes")} <= metrics


def test_injected_accuracy_drop_fails_with_exit_1(tmp_path):
    make_folder(tmp_path / "a")
    dropped = [0] * 8 + NEEDLE[8:]  # accuracy 0.8 -> 0.45: far outside the bootstrap interval
    make_folder(tmp_path / "b", needle_scores=dropped)
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--json", tmp_path / "v.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "| accuracy |" in proc.stdout and "REGRESSION" in proc.stdout
    data = json.loads((tmp_path / "v.json").read_text())
    regs = [(r["metric"], r["base"], r["new"]) for r in data["regressions"]]
    assert regs == [("accuracy", pytest.approx(np.mean(NEEDLE)), pytest.approx(np.mean(dropped)))]
    assert data["regressions"][0]["rule"].startswith("bootstrap 95% over 20 samples")


def test_small_drop_inside_the_bootstrap_interval_passes_but_max_drop_zero_without_samples_fails(tmp_path):
    make_folder(tmp_path / "a")
    one_less = list(NEEDLE)
    one_less[0] = 0  # 0.80 -> 0.75: inside the 95% interval of 20 samples (about +-0.18)
    make_folder(tmp_path / "b", needle_scores=one_less)
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    acc = [r for r in v["rows"] if r["metric"] == "accuracy"][0]
    assert v["ok"] and acc["verdict"] == "ok" and 0.05 < acc["tolerance"] < 0.3
    # without samples.jsonl the tolerance is --max-drop (default 0): the same drop is a regression
    for run in os.listdir(tmp_path / "a"):
        if "needle" in run:
            os.unlink(tmp_path / "a" / run / "samples.jsonl")
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert not v["ok"] and [r["metric"] for r in v["regressions"]] == ["accuracy"]
    assert verdict_of(tmp_path / "a", tmp_path / "b", max_drop=0.1)["ok"]


def test_injected_slowdown_and_kv_growth_fail(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", decode=17.0)  # -15% decode tok/s
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert [(r["metric"], r["verdict"]) for r in v["regressions"]] == [("decode_tokens_per_s", "regression")]
    assert verdict_of(tmp_path / "a", tmp_path / "b", max_slowdown=0.2)["ok"]
    make_folder(tmp_path / "c", decode=19.0)  # -5%: inside the default 10%
    assert verdict_of(tmp_path / "a", tmp_path / "c")["ok"]
    make_folder(tmp_path / "d", peak=1_000_016)
    assert {r["metric"] for r in verdict_of(tmp_path / "a", tmp_path / "d")["regressions"]} == {"peak_kv_bytes"}


def test_perplexity_rise_is_a_regression(tmp_path):
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", ppl_shift=0.5)  # every document's nll +0.5: ppl x1.65
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    regs = sorted((_method(r["run"]), r["metric"]) for r in v["regressions"])
    assert regs == [("full", "ppl"), ("streaming_llm", "ppl")]
    assert verdict_of(tmp_path / "b", tmp_path / "a")["ok"]  # lower perplexity is better, not a regression


def test_runs_on_one_side_are_listed(tmp_path):
    make_folder(tmp_path / "a", extra=True)
    make_folder(tmp_path / "b", drop_needle=True)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # missing runs are listed, not a regression
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["pairs"] == 2 and not v["only_new"]
    assert sorted(_method(name) for name in v["only_base"]) == ["h2o", "snapkv"]
    assert "Only in" in proc.stdout and "h2o" in proc.stdout.split("Only in")[1]


def test_two_commits_in_one_folder(tmp_path):
    make_folder(tmp_path / "r", commit="aaaa1111", finished_at="2026-11-30T10:00:00+00:00")
    make_folder(tmp_path / "r", commit="bbbb2222", decode=10.0, finished_at="2026-11-30T11:00:00+00:00")
    proc = run_cli(tmp_path / "r", "--base-commit", "aaaa", "--new-commit", "bbbb")
    assert proc.returncode == 1 and "decode_tokens_per_s" in proc.stdout, proc.stdout + proc.stderr
    v = compare.compare(compare.select_runs(str(tmp_path / "r"), "aaaa"), compare.select_runs(str(tmp_path / "r"), "bbbb"))
    assert v["pairs"] == 3 and [r["metric"] for r in v["regressions"]] == ["decode_tokens_per_s"]
    proc = run_cli(tmp_path / "r", "--base-commit", "zzzz", "--new-commit", "bbbb")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "aaaa1111" in proc.stderr, proc.stderr


def test_pairing_ignores_the_code_version_but_not_the_setting(tmp_path):
    make_folder(tmp_path / "a", commit="aaaa1111")
    make_folder(tmp_path / "b", commit="bbbb2222")
    base, new = compare.select_runs(str(tmp_path / "a")), compare.select_runs(str(tmp_path / "b"))
    assert set(base) == set(new) and len(base) == 3


def test_bad_input_is_one_line_exit_2(tmp_path):
    proc = run_cli(tmp_path / "nope", tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and str(tmp_path / "nope") in proc.stderr


def test_bootstrap_statistics_reproduce_the_recorded_metrics():
    s = fx.ppl_samples(PPL_NLLS)
    fn = stats.statistic("ppl", s, fx.ppl_of(s))
    assert fn(np.arange(len(s))) == pytest.approx(fx.ppl_of(s))
    lo, hi = stats.bootstrap_interval(fn, len(s))
    assert lo < fx.ppl_of(s) < hi and hi / lo < 1.5
    lb = fx.score_samples([1, 0, 1, 1], "qasper") + fx.score_samples([0.5, 0.5], "trec")
    fn = stats.statistic("score", lb, 100 * (0.75 + 0.5) / 2)  # LongBench: mean over datasets, x100
    assert fn(np.arange(6)) == pytest.approx(62.5)
    fn = stats.statistic("score_trec", lb, 50.0)
    assert fn(np.arange(2)) == pytest.approx(50.0)
    assert stats.lower_is_better("ppl") and not stats.lower_is_better("accuracy")
    assert stats.is_score("score_qasper") and stats.is_score("arc_easy/acc,none") and not stats.is_score("acc_1024_50")
    assert math.isfinite(stats.bootstrap_interval(lambda idx: 1.0, 1)[0])


def test_a_setting_added_by_a_newer_version_still_pairs(tmp_path):
    """NEW's configs carry a runtime key BASE's lack (a newer version, default value): runs still pair on the keys
    both know, the key is listed, and a changed value of a shared key still separates runs."""
    make_folder(tmp_path / "a")
    make_folder(tmp_path / "b", decode=10.0)
    for run in os.listdir(tmp_path / "b"):
        path = tmp_path / "b" / run / "config.yaml"
        if path.is_file():
            path.write_text(path.read_text().replace("runtime:\n", "runtime:\n  max_num_seqs: 256\n"))
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    assert v["pairs"] == 3 and v["ignored_keys"] == ["runtime.max_num_seqs"]
    assert [r["metric"] for r in v["regressions"]] == ["decode_tokens_per_s"]
    assert "runtime.max_num_seqs" in compare.to_markdown(v, "a", "b")
    make_folder(tmp_path / "c")
    for run in os.listdir(tmp_path / "c"):
        path = tmp_path / "c" / run / "config.yaml"
        if path.is_file():
            path.write_text(path.read_text().replace("block_size: 16", "block_size: 32"))
    v = verdict_of(tmp_path / "a", tmp_path / "c")
    assert v["pairs"] == 0 and len(v["only_base"]) == len(v["only_new"]) == 3
