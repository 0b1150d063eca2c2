"""kvbench-report on hand-made results folders: the tables hold the runs' values beside the paper's with the right
differences, each row links its run folder, the HTML is self-contained, and each kind of plot appears when (and only
when) its runs exist."""
from __future__ import annotations

import base64
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from kvbench import report  # noqa: E402
from tests import results_fixtures as fx  # noqa: E402

SINK_PPL = {0: 812.5, 1: 30.25, 4: 27.5, 8: 27.0}
KIVI_PAPER = {"source": "KIVI", "model": "org/mistral", "dataset": "LongBench", "metric": "score",
              "rows": [{"label": "fp16", "match": {"quant.name": "none"}, "value": 43.54, "model": "org/mistral",
                        "per_dataset": {"qasper": 29.41, "trec": 71.0}},
                       {"label": "KIVI-2", "match": {"quant.name": "kivi", "quant.bits": 2}, "value": 42.43,
                        "model": "org/mistral", "per_dataset": {"qasper": 28.73, "trec": 71.0}}]}


def sinks_folder(path, commit="c0ffee01", finished_at="2026-11-30T10:00:00+00:00", shift=0.0):
    for sinks, ppl in SINK_PPL.items():
        cfg = fx.config(method="streaming_llm", budget=256, method_options={"sinks": sinks},
                        experiment="streaming_llm_sinks", paper=fx.STREAMING_PAPER)
        fx.write_run(str(path), cfg, {"ppl": ppl + shift, "peak_kv_bytes": 2**20 * (1 + sinks)},
                     fx.ppl_samples([1.0]), commit=commit, finished_at=finished_at)


def sweep_folder(path):
    """budget_sweep-like runs: perplexity and needle over budgets for two methods, a codec, and a throughput run."""
    for method, base in (("streaming_llm", 30.0), ("h2o", 25.0)):
        for budget in (128, 256, 512):
            cfg = fx.config(method=method, budget=budget, experiment="budget_sweep")
            fx.write_run(str(path), cfg, {"ppl": base + 1000 / budget, "peak_kv_bytes": budget * 46080},
                         fx.ppl_samples([3.0]))
            cfg = fx.config(method=method, budget=budget, task="needle", experiment="budget_sweep")
            cells = {f"acc_1024_{d}": float(budget >= 256 or d == 100) for d in (0, 50, 100)}
            fx.write_run(str(path), cfg, {"accuracy": sum(cells.values()) / 3, "decode_tokens_per_s": 20.0 + budget / 100,
                                          "peak_kv_bytes": budget * 46080, **cells}, fx.score_samples([1, 0, 1]))
    cfg = fx.config(method="full", budget=128, quant={"name": "kivi", "bits": 2}, experiment="budget_sweep")
    fx.write_run(str(path), cfg, {"ppl": 26.0, "peak_kv_bytes": 5000}, fx.ppl_samples([3.2]))
    for mem in (2**24, 2**25):
        cfg = fx.config(method="full", task="throughput", task_options={"kv_memory": mem})
        fx.write_run(str(path), cfg, {"output_tokens_per_s": mem / 2**20 * 10, "kv_pool_bytes": mem,
                                      "max_running_seqs": mem // 2**22}, [])


def longbench_folder(path):
    for quant, per in (({"name": "none"}, {"qasper": 30.0, "trec": 70.0}),
                       ({"name": "kivi", "bits": 2}, {"qasper": 27.0, "trec": 69.0})):
        cfg = fx.config(task="longbench", quant=quant, experiment="kivi_longbench", paper=KIVI_PAPER,
                        model_path="org/mistral")
        metrics = {"score": sum(per.values()) / 2, **{f"score_{d}": v for d, v in per.items()}}
        fx.write_run(str(path), cfg, metrics, fx.score_samples([0.3], "qasper") + fx.score_samples([0.7], "trec"))


def section(path, name):
    names, groups = report.build(str(path), name)
    (exp, runs, history), = groups
    return report.experiment_section(exp, runs, history, str(path / "out"))


def test_table_puts_paper_values_beside_ours(tmp_path):
    sinks_folder(tmp_path)
    sec = section(tmp_path, "streaming_llm_sinks")
    table, = sec.tables
    col = {c: i for i, c in enumerate(table.columns)}
    rows = {r[col["paper row"]]: r for r in table.rows}
    assert set(rows) == {"0 sinks", "1 sinks", "4 sinks", ""}  # 8 sinks: no published row
    for label, sinks, published in (("0 sinks", 0, 3359.95), ("1 sinks", 1, 11.88), ("4 sinks", 4, 9.59)):
        r = rows[label]
        assert float(r[col["ours"]]) == pytest.approx(SINK_PPL[sinks])
        assert float(r[col["paper"]].replace(",", "")) == pytest.approx(published, rel=1e-3)
        assert r[col["diff"]] == "not compared: other model or data"  # smollm2, not Llama-2-7B: no raw difference
        assert r[col["setting"]] == f"method.sinks={sinks}"
        assert r[col["metric"]] == "ppl" and r[col["model (dtype)"]] == "smollm2-135m (float32)"
        assert r[col["commit"]] == "c0ffee01" and "torch 2.13.0" in r[col["versions"]]
        text, href = r[col["run"]]
        assert os.path.isfile(os.path.normpath(os.path.join(tmp_path / "out", href, "metrics.json")))
    assert float(rows[""][col["ours"]]) == pytest.approx(27.0) and rows[""][col["paper"]] == ""
    assert any("arXiv" in line or "Table 2" in line for line in sec.lines)
    assert sorted(t for t, _ in sec.plots) == ["perplexity: ppl vs KV memory (Pareto front)", "perplexity: ppl vs method.sinks"]


def test_same_model_rows_and_longbench_bars(tmp_path):
    longbench_folder(tmp_path)
    sec = section(tmp_path, "kivi_longbench")
    table, = sec.tables
    col = {c: i for i, c in enumerate(table.columns)}
    rows = {r[col["paper row"]]: r for r in table.rows}
    assert rows["fp16"][col["diff"]] == f"{50.0 - 43.54:+.4g}"  # same model: no "(other model)" note
    assert rows["KIVI-2"][col["diff"]] == f"{48.0 - 42.43:+.4g}"
    titles = [t for t, _ in sec.plots]
    assert "LongBench per dataset" in titles
    assert not any("needle" in t or "throughput" in t or "history" in t for t in titles)


def test_sweep_plots_and_tables_per_task(tmp_path):
    sweep_folder(tmp_path)
    sec = section(tmp_path, "budget_sweep")
    assert [t.title for t in sec.tables] == ["task needle", "task perplexity"]
    needle, ppl = sec.tables
    col = {c: i for i, c in enumerate(ppl.columns)}
    values = {r[col["setting"]]: float(r[col["ours"]]) for r in ppl.rows}
    assert values["budget=256, method=h2o, quant=none"] == pytest.approx(25.0 + 1000 / 256, rel=1e-4)
    assert values["budget=128, method=full, quant=kivi"] == pytest.approx(26.0)
    titles = [t for t, _ in sec.plots]
    for wanted in ("perplexity: ppl vs budget", "perplexity: ppl vs KV memory (Pareto front)",
                   "needle: accuracy vs budget", "needle: needle accuracy per cell", "needle: decode tokens/s vs budget"):
        assert wanted in titles, titles
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for _, png in sec.plots)
    other = section(tmp_path, report.NO_EXPERIMENT)
    assert "throughput vs KV memory" in [t for t, _ in other.plots]


def test_history_plot_with_runs_of_two_commits(tmp_path):
    sinks_folder(tmp_path, commit="aaaa1111", finished_at="2026-11-30T10:00:00+00:00")
    sec = section(tmp_path, "streaming_llm_sinks")
    assert not any(t.startswith("history") for t, _ in sec.plots)
    sinks_folder(tmp_path, commit="bbbb2222", finished_at="2026-11-30T11:00:00+00:00", shift=1.0)
    sec = section(tmp_path, "streaming_llm_sinks")
    assert "history: ppl per commit" in [t for t, _ in sec.plots]
    table, = sec.tables  # the table shows the latest attempt of each run
    col = {c: i for i, c in enumerate(table.columns)}
    assert {r[col["commit"]] for r in table.rows} == {"bbbb2222"}


def test_cli_writes_self_contained_html_and_markdown(tmp_path):
    sinks_folder(tmp_path / "res")
    longbench_folder(tmp_path / "res")
    proc = subprocess.run([sys.executable, "-m", "kvbench.report", str(tmp_path / "res"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "o" / "report.html").read_text()
    md = (tmp_path / "o" / "report.md").read_text()
    assert "<h2 id=\"streaming_llm_sinks\">" in html and "<h2 id=\"kivi_longbench\">" in html
    assert "3,359.95" in html and "11.88" in md
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing fetched from the network
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert images and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    for link in re.findall(r"\]\((plots/[^)]+\.png)\)", md):
        assert (tmp_path / "o" / link).is_file()
    for href in re.findall(r'href="([^"#]+)"', html):
        assert os.path.isdir(os.path.join(tmp_path / "o", href)), href
    import pandas as pd

    frame = pd.read_csv(tmp_path / "o" / "runs.csv")
    assert len(frame) == len(SINK_PPL) + 2
    sinks = frame[frame["experiment"] == "streaming_llm_sinks"].set_index("cfg.method.sinks")["ppl"].to_dict()
    assert sinks == pytest.approx({float(k): v for k, v in SINK_PPL.items()})


def test_bad_input_is_one_line_exit_2(tmp_path):
    sinks_folder(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvbench.report", str(tmp_path), "--experiment", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'nope'" in proc.stderr and "streaming_llm_sinks" in proc.stderr
