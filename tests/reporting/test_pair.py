"""Issue 67, item 2: `kvbench-compare --pair RUN_A RUN_B`, a paired verdict of one method against another over the
samples (or perplexity windows) both runs scored. Both ways: identical runs are "no difference"; a planted
difference is found; a short noisy run is inconclusive (exit 3); runs over different data are refused in one line
(exit 2); a failed run or a missing / NaN score never passes (exit 1)."""
from __future__ import annotations

import json
import math

import pytest

from kvbench.reporting import pair
from kvbench.store.runs import make_run
from tests import results_fixtures as fx
from tests.reporting.test_compare import run_cli

SCORES = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0] * 8  # 64 needle-like samples, 5/8 right


def ruler_run(folder, method, ratio, scores, *, metric_value=None, task_options=None, status="ok", dataset="niah"):
    cfg = fx.config(method=method, compression_ratio=ratio, task="ruler",
                    task_options=task_options or {"max_tokens": 4096})
    samples = fx.score_samples(scores, dataset)
    value = 100 * sum(scores) / len(scores) if metric_value is None else metric_value
    rec = fx.write_run(str(folder), cfg, {"score": value, f"score_{dataset}": value}, samples, status=status)
    return rec["run_dir"]


def test_identical_runs_are_no_difference(tmp_path):
    a = ruler_run(tmp_path, "snapkv", 0.5, SCORES)
    b = ruler_run(tmp_path, "expected_attention", 0.5, SCORES)
    proc = run_cli("--pair", a, b, "--json", tmp_path / "v.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("snapkv@0.5 vs expected_attention@0.5, score: +0 [+0, +0], no difference")
    v = json.loads((tmp_path / "v.json").read_text())
    assert v["verdict"] == "no difference" and v["interval"] == [0.0, 0.0] and v["items"] == 64


def test_a_planted_difference_is_found_both_ways(tmp_path):
    worse = [s if i % 4 else 0.0 for i, s in enumerate(SCORES)]  # A loses 1 of every 8 answers
    a = ruler_run(tmp_path, "snapkv", 0.5, worse)
    b = ruler_run(tmp_path, "expected_attention", 0.5, SCORES)
    proc = run_cli("--pair", a, b)
    assert proc.returncode == 0, proc.stdout
    assert "snapkv@0.5 worse" in proc.stdout
    v = pair.pair_verdict(_run(a), _run(b))
    lo, hi = v["interval"]
    assert v["change"] == pytest.approx(100 * (sum(worse) - sum(SCORES)) / 64) and lo <= v["change"] <= hi < 0
    # the other way round, the same data: B better
    back = pair.pair_verdict(_run(b), _run(a))
    assert back["verdict"] == "better" and back["interval"] == pytest.approx([-hi, -lo])
    # perplexity: lower is better, a rise on every window is "worse"
    pa = _ppl_run(tmp_path, "snapkv", 3.2)
    pb = _ppl_run(tmp_path, "full", 3.0)
    assert pair.pair_verdict(_run(pa), _run(pb))["verdict"] == "worse"
    assert pair.pair_verdict(_run(pb), _run(pa))["verdict"] == "better"


def test_a_change_the_data_cannot_resolve_is_inconclusive(tmp_path):
    short = [1.0, 0.0, 1.0, 1.0]
    a = ruler_run(tmp_path, "snapkv", 0.5, [0.0, 0.0, 1.0, 1.0])
    b = ruler_run(tmp_path, "expected_attention", 0.5, short)
    proc = run_cli("--pair", a, b)
    assert proc.returncode == 3, proc.stdout
    assert ", inconclusive (" in proc.stdout and "-25 [" in proc.stdout


def test_runs_over_different_data_are_refused_in_one_line(tmp_path):
    a = ruler_run(tmp_path, "snapkv", 0.5, SCORES)
    b = ruler_run(tmp_path, "expected_attention", 0.5, SCORES, task_options={"max_tokens": 8192})
    proc = run_cli("--pair", a, b)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "task.max_tokens is 4096 in A and 8192 in B" in proc.stderr
    assert "Traceback" not in proc.stderr
    c = ruler_run(tmp_path / "other", "expected_attention", 0.5, SCORES, dataset="qa")  # other items, same config
    proc = run_cli("--pair", a, c)
    assert proc.returncode == 2 and "not the same items" in proc.stderr and proc.stderr.count("\n") == 1
    proc = run_cli("--pair", a, tmp_path / "nowhere")
    assert proc.returncode == 2 and "no run folder" in proc.stderr


@pytest.mark.parametrize("how", ["nan", "missing", "failed"])
def test_missing_nan_or_failed_never_pass(tmp_path, how):
    a = ruler_run(tmp_path, "snapkv", 0.5, SCORES, metric_value=math.nan if how == "nan" else None,
                  status="failed" if how == "failed" else "ok")
    if how == "missing":
        path = tmp_path / a.split("/")[-1] / "metrics.json"
        rec = json.loads(path.read_text())
        del rec["score"], rec["score_niah"]
        path.write_text(json.dumps(rec))
    b = ruler_run(tmp_path, "expected_attention", 0.5, SCORES)
    proc = run_cli("--pair", a, b, "--metric", "score")
    assert proc.returncode == 1, proc.stdout
    assert ": missing (" in proc.stdout and "no difference" not in proc.stdout


def test_report_vs_full_column_has_the_interval(tmp_path):
    from kvbench.reporting.report import run_table
    from kvbench.store.runs import load_runs
    ruler_run(tmp_path, "full", None, SCORES)
    ruler_run(tmp_path, "snapkv", 0.5, [s if i % 4 else 0.0 for i, s in enumerate(SCORES)])
    runs = load_runs(str(tmp_path))
    table, _ = run_table(runs, None, str(tmp_path / "report"), "runs")
    col = table.columns.index("vs full")
    cells = {row[0]: row[col] for row in table.rows}
    snap = next(v for k, v in cells.items() if "snapkv" in k)
    assert snap.startswith("-12.5 (-20.0%) [") and snap.endswith("]")
    lo, hi = (float(x) for x in snap.split("[")[1].rstrip("]").split(","))
    assert lo <= -12.5 <= hi < 0


def _run(run_dir: str) -> dict:
    import os
    from kvbench.store.files import read_json
    return make_run(os.path.dirname(run_dir), read_json(os.path.join(run_dir, "metrics.json")), run_dir=run_dir)


def _ppl_run(folder, method: str, nll: float) -> str:
    cfg = fx.config(method=method, budget=None if method == "full" else 64, task_options={"max_tokens": 1024})
    s = fx.ppl_samples([nll, nll + 0.1], tokens=512, windows=8, spread=0.2)
    ppl = fx.ppl_of(s)
    return fx.write_run(str(folder), cfg, {"ppl": ppl, "nll": math.log(ppl)}, s)["run_dir"]


def test_one_item_or_no_samples_is_inconclusive_never_a_verdict(tmp_path):
    a = ruler_run(tmp_path, "snapkv", 0.5, [1.0])
    b = ruler_run(tmp_path, "expected_attention", 0.5, [1.0])
    proc = run_cli("--pair", a, b)
    assert proc.returncode == 3 and "inconclusive (1 item: no interval)" in proc.stdout
    for run_dir in (a, b):
        (tmp_path / run_dir.split("/")[-1] / "samples.jsonl").unlink()
    proc = run_cli("--pair", a, b)
    assert proc.returncode == 3 and "no per-sample records" in proc.stdout
