"""kvbench-report on hand-made results folders: the tables hold the runs' values beside the paper's with the right
differences, each row links its run folder, the HTML is self-contained, and each kind of plot appears when (and only
when) its runs exist."""
from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from kvbench.reporting import report  # noqa: E402
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
    for label, sinks in (("0 sinks", 0), ("1 sinks", 1), ("4 sinks", 4)):
        r = rows[label]
        assert float(r[col["ours"]]) == pytest.approx(SINK_PPL[sinks])
        # smollm2, not Llama-2-7B: the published value is not set beside ours, and no raw difference
        assert r[col["paper"]] == "" and r[col["diff"]] == "not compared: other model or data (see the claims)"
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
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "res"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    html = (tmp_path / "o" / "report.html").read_text()
    md = (tmp_path / "o" / "report.md").read_text()
    assert "<h2 id=\"streaming_llm_sinks\">" in html and "<h2 id=\"kivi_longbench\">" in html
    assert "3,359.95" not in html and "11.88" not in md  # published values of another model: not beside ours
    assert "43.54" in html and "42.43" in md  # the KIVI runs are on the paper's model (org/mistral)
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
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path), "--experiment", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "'nope'" in proc.stderr and "streaming_llm_sinks" in proc.stderr


# ---------------------------------------------------------------- claims of the paper, judged both ways
CLAIM_PAPER = {
    "source": "StreamingLLM, Table 2", "model": "meta-llama/Llama-2-7b-hf", "dataset": "PG19", "metric": "ppl",
    "lower_is_better": True, "data_match": {"task.corpus": "pg19"},
    "rows": [{"id": f"s{s}", "label": f"{s} sinks", "match": {"method.sinks": s}, "value": v}
             for s, v in ((0, 3359.95), (1, 11.88), (4, 9.59))],
    "claims": [{"claim": "window only > 10x 4 sinks", "ratio": ["s0", "s4"], "min": 10},
               {"claim": "1 sink within 25% of 4 sinks", "ratio": ["s1", "s4"], "max": 1.25},
               {"claim": "4 < 1 < 0 sinks", "order": ["s4", "s1", "s0"]}],
}


def claim_folder(path, ppl: dict, experiment="sinks_claims", paper=None):
    for sinks, value in ppl.items():
        cfg = fx.config(method="streaming_llm", budget=256, method_options={"sinks": sinks}, experiment=experiment,
                        paper=paper or CLAIM_PAPER)
        fx.write_run(str(path), cfg, {"ppl": value, "peak_kv_bytes": 2**20}, fx.ppl_samples([1.0]))


def verdicts(path, name="sinks_claims"):
    sec = section(path, name)
    return sec.verdict[0], {v.claim: v for v in sec.verdicts}


def test_claims_reproduced_when_our_rows_satisfy_them(tmp_path):
    claim_folder(tmp_path, {0: 400.0, 1: 30.0, 4: 27.0})
    verdict, by = verdicts(tmp_path)
    assert verdict == "reproduced"
    v = by["window only > 10x 4 sinks"]
    assert v.verdict == "reproduced" and v.ours == f"x{400 / 27:.4g}" and v.paper == f"x{3359.95 / 9.59:.4g}"
    assert by["1 sink within 25% of 4 sinks"].ours == f"x{30 / 27:.4g}"
    assert by["4 < 1 < 0 sinks"].ours == "27 < 30 < 400" and by["4 < 1 < 0 sinks"].paper == "9.59 < 11.88 < 3,359.95"


def test_claims_not_reproduced_when_violated(tmp_path):
    claim_folder(tmp_path, {0: 44.0, 1: 36.0, 4: 37.0})  # no collapse, 1 sink better than 4: the smoke picture
    verdict, by = verdicts(tmp_path)
    assert verdict == "not reproduced"
    assert by["window only > 10x 4 sinks"].verdict == "not reproduced"
    assert by["1 sink within 25% of 4 sinks"].verdict == "reproduced"
    order = by["4 < 1 < 0 sinks"]
    assert order.verdict == "not reproduced" and order.ours == "37 > 36 < 44"


def test_claims_not_run_when_rows_are_missing(tmp_path):
    claim_folder(tmp_path, {1: 30.0, 4: 27.0})  # no 0-sink run
    verdict, by = verdicts(tmp_path)
    assert by["window only > 10x 4 sinks"].verdict == "not run"
    assert "no run of 0 sinks" in by["window only > 10x 4 sinks"].why
    assert by["1 sink within 25% of 4 sinks"].verdict == "reproduced"
    assert verdict == "inconclusive"  # never "reproduced" with a claim unjudged
    claim_folder(tmp_path / "none", {1: 30.0})
    assert verdicts(tmp_path / "none")[0] == "not run"  # no claim judged at all


@pytest.mark.parametrize("bad", [float("nan"), None, float("inf")])
def test_claims_with_a_missing_value_are_never_reproduced(tmp_path, bad):
    claim_folder(tmp_path, {0: 400.0, 1: bad, 4: 27.0})
    verdict, by = verdicts(tmp_path)
    assert by["1 sink within 25% of 4 sinks"].verdict == "not reproduced"
    assert "1 sinks has no ppl" in by["1 sink within 25% of 4 sinks"].settings[0][1]
    assert by["window only > 10x 4 sinks"].verdict == "reproduced"
    assert verdict == "not reproduced"


def test_failed_run_counts_as_no_value(tmp_path):
    claim_folder(tmp_path, {0: 400.0, 4: 27.0})
    cfg = fx.config(method="streaming_llm", budget=256, method_options={"sinks": 1}, experiment="sinks_claims",
                    paper=CLAIM_PAPER)
    fx.write_run(str(tmp_path), cfg, {"ppl": 28.0}, [], status="failed")
    _, by = verdicts(tmp_path)
    assert by["1 sink within 25% of 4 sinks"].verdict == "not reproduced"
    assert "status failed" in by["1 sink within 25% of 4 sinks"].settings[0][1]


def test_claims_judged_per_comparable_setting(tmp_path):
    """A sweep over budget x block size: each (budget, block) setting is judged; full (budget null) joins each."""
    paper = {"source": "s", "model": "m", "dataset": "d", "metric": "ppl", "lower_is_better": True,
             "rows": [{"id": "p", "label": "paged", "match": {"method.name": "paged_eviction"}, "value": None},
                      {"id": "f", "label": "full", "match": {"method.name": "full"}, "value": None}],
             "claims": [{"claim": "full <= paged", "order": ["f", "p"], "strict": False}]}
    for bs in (8, 16):
        cfg = fx.config(method="full", experiment="grid", paper=paper, block_size=bs)
        fx.write_run(str(tmp_path), cfg, {"ppl": 20.0}, fx.ppl_samples([1.0]))
        for budget, value in ((128, 25.0), (256, 21.0 if bs == 8 else 19.0)):
            cfg = fx.config(method="paged_eviction", budget=budget, experiment="grid", paper=paper, block_size=bs)
            fx.write_run(str(tmp_path), cfg, {"ppl": value}, fx.ppl_samples([1.0]))
    verdict, by = verdicts(tmp_path, "grid")
    v = by["full <= paged"]
    assert len(v.settings) == 4 and v.ours == "holds in 3 of 4 settings" and verdict == "not reproduced"
    assert "runtime.block_size=16, budget=256: 20 > 19" in v.why
    assert v.paper.startswith("unknown")


def test_stand_in_metric_is_never_set_beside_the_papers(tmp_path):
    """h2o at smoke scale: the paper reports accuracy, the runs have ppl: the relation is judged in ppl, the paper's
    figure is not shown, and the table shows no published value or difference."""
    paper = {"source": "H2O", "model": "huggyllama/llama-7b", "dataset": "lm-eval", "metric": "accuracy",
             "lower_is_better": False,
             "rows": [{"id": "h", "label": "H2O", "match": {"method.name": "h2o"}, "value": 0.5},
                      {"id": "r", "label": "recent", "match": {"method.name": "streaming_llm"}, "value": 0.4}],
             "claims": [{"claim": "H2O beats recent", "order": ["h", "r"]}]}
    for method, ppl in (("h2o", 26.5), ("streaming_llm", 49.0)):
        cfg = fx.config(method=method, budget=205, experiment="h2o_like", paper=paper)
        fx.write_run(str(tmp_path), cfg, {"ppl": ppl}, fx.ppl_samples([1.0]))
    sec = section(tmp_path, "h2o_like")
    v, = sec.verdicts
    assert v.verdict == "reproduced" and v.ours == "26.5 < 49" and "stand-in" in v.metric
    assert "not comparable" in v.paper and "0.5" not in v.paper
    runs_table = sec.tables[-1]
    col = {c: i for i, c in enumerate(runs_table.columns)}
    for row in runs_table.rows:
        assert row[col["paper"]] == "" and row[col["diff"]] == "not compared: paper reports accuracy"


def test_verdicts_in_terminal_markdown_html_and_json(tmp_path):
    claim_folder(tmp_path / "res", {0: 44.0, 1: 30.0, 4: 27.0})
    out, js = tmp_path / "o", tmp_path / "v.json"
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "res"), "--out", str(out),
                           "--json", str(js)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    scale = "scale: smollm2-135m, not the paper's model (meta-llama/Llama-2-7b-hf); 3 runs of 1 sample each"
    assert f"sinks_claims: not reproduced (2 reproduced, 1 not reproduced (of 3 claims); {scale})" in proc.stdout
    # beside each claim: the interval and what it resampled (one document without windows: no interval)
    assert "[not reproduced] window only > 10x 4 sinks (ppl; ratio >= 10): ours x1.63 95% x[1.63, 1.63] (unpaired, " \
           "1 sample per run; no interval for s0, s4 (fewer than 2 samples, or no samples.jsonl)) | paper x350.4" \
           in proc.stdout, proc.stdout
    import json

    data = json.loads(js.read_text())["sinks_claims"]
    assert data["verdict"] == "not reproduced" and scale in data["summary"]
    assert [c["verdict"] for c in data["claims"]] == ["not reproduced", "reproduced", "reproduced"]
    assert data["claims"][0]["interval"] == "x[1.63, 1.63]" and data["claims"][0]["settings"][0]["bounds"]
    assert data["claims"][2]["interval"] == "s1-s4 [+3, +3]; s0-s1 [+14, +14]"
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "Verdicts: sinks\\_claims: not reproduced." in md
    assert "**Verdict: not reproduced** (2 reproduced, 1 not reproduced (of 3 claims); scale: smollm2-135m" in md
    assert "window only &gt; 10x 4 sinks" in md  # escaped as in HTML
    assert "| 95% interval | items |" in md and "s1-s4 \\[+3, +3\\]" in md
    assert 'class="verdict bad"' in html and '<td class="good">reproduced</td>' in html
    assert "<th>95% interval</th>" in html and "x[1.63, 1.63]" in html


BAD_PAPERS = [
    ({"rows": [{"label": "a", "match": {"method.sinks": 0}, "value": "abc"}]}, "value must be a finite number"),
    ({"rows": [{"label": "a", "match": {"method.sinks": 0}, "value": 1.0}],
      "claims": [{"claim": "c", "order": ["a", "nope"]}]}, "names row 'nope'"),
    ({"rows": [{"label": "a", "match": {"method.sinks": 0}, "value": 1.0},
               {"label": "b", "match": {"method.sinks": 1}, "value": 2.0}],
      "claims": [{"claim": "b better", "order": ["b", "a"]}]}, "does not hold for the paper's own values"),
    ({"rows": [{"label": "a", "match": {"method.sinks": 0}, "value": 1.0},
               {"label": "b", "match": {"method.sinks": 1}, "value": 2.0}],
      "claims": [{"claim": "r", "ratio": ["a", "b"]}]}, "needs min and/or max"),
    ({"metric": None}, "metric must be"),
    ({"rows": "x"}, "rows must be a list"),
    ({"lower_is_better": "yes"}, "lower_is_better must be true or false"),
]


@pytest.mark.parametrize("change,message", BAD_PAPERS)
def test_bad_paper_block_is_one_line_exit_2(tmp_path, change, message):
    paper = {"source": "s", "model": "m", "dataset": "d", "metric": "ppl", "lower_is_better": True, "rows": []}
    paper.update(change)
    claim_folder(tmp_path / "res", {0: 44.0}, paper=paper)
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "res"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "sinks_claims" in proc.stderr and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()  # found before anything is written


def test_bad_out_and_json_paths_are_one_line_exit_2(tmp_path):
    claim_folder(tmp_path / "res", {0: 44.0, 1: 30.0, 4: 27.0})
    (tmp_path / "file").write_text("x")
    cases = [(["--out", str(tmp_path / "file")], "is a file"),
             (["--out", str(tmp_path / "file" / "sub")], "cannot create"),
             (["--json", str(tmp_path)], "is a folder"),
             (["--json", str(tmp_path / "nope" / "v.json")], "no folder")]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "res"), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, (args, proc.stderr)
        assert not (tmp_path / "res" / "report").exists()


# ---------------------------------------------------------------- plots and rendering
def _figures(monkeypatch):
    """Capture the matplotlib figures the plot functions make (their PNGs are not needed)."""
    from kvbench.reporting import plots

    figs = []
    monkeypatch.setattr(plots, "_png", lambda fig, dpi=80: figs.append(fig) or b"png")
    return figs


def _runs(points, task_options=None):
    """plot records: (method, budget, ppl)."""
    out = []
    for method, budget, ppl in points:
        cfg = {"method.name": method, "quant.name": "none", "task.name": "perplexity",
               **{f"task.{k}": v for k, v in (task_options or {}).items()}}
        out.append({"cfg": cfg, "metrics": {"method": method, "budget": budget, "ppl": ppl,
                                             "peak_kv_bytes": (budget or 4096) * 1000}})
    return out


def test_one_colour_per_method_in_every_plot(monkeypatch):
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    a = _runs([("h2o", 128, 27.0), ("h2o", 512, 26.0), ("snapkv", 128, 27.5), ("snapkv", 512, 26.2)])
    b = _runs([("snapkv", 128, 30.0), ("snapkv", 512, 29.0),
               ("streaming_llm", 128, 31.0), ("streaming_llm", 512, 29.5)])
    plots.metric_vs_budget(a, "ppl")
    plots.metric_vs_budget(b, "ppl")
    plots.pareto(b + a, "ppl")
    colour = {}
    for fig in figs:
        ax = fig.axes[0]
        items = [(line.get_label(), line.get_color()) for line in ax.lines] + \
                [(c.get_label(), tuple(c.get_facecolor()[0])) for c in ax.collections]
        for label, col in items:
            method = label.split(" ")[0]
            if method in ("h2o", "snapkv", "streaming_llm"):
                from matplotlib.colors import to_hex

                colour.setdefault(method, set()).add(to_hex(col))
    assert colour["snapkv"] == {plots.METHOD_COLORS["snapkv"]}  # the same in all three plots
    assert colour["h2o"] == {plots.METHOD_COLORS["h2o"]}
    assert colour["streaming_llm"] == {plots.METHOD_COLORS["streaming_llm"]}
    assert len(set(plots.METHOD_COLORS[m] for m in ("full", "h2o", "snapkv", "streaming_llm", "paged_eviction"))) == 5
    assert plots.method_color("new_method") == plots.method_color("new_method")  # unknown: a stable pick


def test_narrow_range_axis_is_linear_wide_range_is_log(monkeypatch):
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    narrow_runs = [("h2o", 128, 26.3), ("h2o", 512, 25.7), ("snapkv", 128, 26.1), ("snapkv", 512, 25.8)]
    plots.metric_vs_budget(_runs(narrow_runs), "ppl")
    plots.metric_vs_budget(_runs([("h2o", 128, 3000.0), ("h2o", 2048, 26.0)]), "ppl")
    narrow, wide = figs
    assert narrow.axes[0].get_yscale() == "linear" and narrow.axes[0].get_xscale() == "linear"  # 128-512: 4x
    assert wide.axes[0].get_yscale() == "log" and wide.axes[0].get_xscale() == "log"  # 26-3000, 128-2048


def test_lines_only_among_comparable_runs(tmp_path):
    """A 4,096-token full run is not drawn across 1,024-token runs: one plot per task setting."""
    for tokens, base in ((1024, 26.0), (4096, 20.0)):
        cfg = fx.config(method="full", task_options={"max_tokens": tokens}, experiment="cmp")
        fx.write_run(str(tmp_path), cfg, {"ppl": base, "peak_kv_bytes": tokens * 46080}, fx.ppl_samples([1.0]))
        for budget in (128, 256):
            cfg = fx.config(method="h2o", budget=budget, task_options={"max_tokens": tokens}, experiment="cmp")
            fx.write_run(str(tmp_path), cfg, {"ppl": base + 1000 / budget, "peak_kv_bytes": budget * 46080},
                         fx.ppl_samples([1.0]))
    titles = [t for t, _ in section(tmp_path, "cmp").plots]
    assert "perplexity: ppl vs budget [task.max_tokens=1024]" in titles
    assert "perplexity: ppl vs budget [task.max_tokens=4096]" in titles
    assert "perplexity: ppl vs budget" not in titles


def test_empty_columns_are_left_out(tmp_path):
    sinks_folder(tmp_path / "res")
    subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(tmp_path / "res"), "--out", str(tmp_path / "o")],
                   check=True, capture_output=True, timeout=120)
    md = (tmp_path / "o" / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| setting"))
    assert "decode tok/s" not in header and "peak KV MiB" in header  # perplexity runs have no decode speed


def test_markdown_escapes_like_html(tmp_path):
    from kvbench.reporting.render import Section, Table, to_html, to_markdown

    evil = "<script>alert(1)</script> a|b [x](javascript:y) *z*"
    sec = Section(title=f"exp {evil}", lines=[f"note {evil} `code`"],
                  tables=[Table(evil, ["setting", "run"], [[evil, (evil, "run dir/")]])])
    md = to_markdown(f"title {evil}", [evil], [sec], str(tmp_path))
    html = to_html(f"title {evil}", [evil], [sec])
    assert "<script>" not in md and "<script>" not in html
    assert "&lt;script&gt;" in md and "&lt;script&gt;" in html
    assert "](javascript" not in md.replace("\\](", "") and "\\[x\\]" in md and "a\\|b" in md and "\\*z\\*" in md
    assert "[&lt;script&gt;alert(1)&lt;/script&gt; a\\|b" in md and "(run%20dir/)" in md  # a link, escaped
    assert "`code`" in md


def test_a_row_recorded_by_another_experiment_is_used_only_when_comparable(tmp_path):
    """One run per result config: budget_sweep's full run may be the run kvquant_ppl recorded. It is used for a
    claim only when its model, task and runtime settings equal this experiment's runs'."""
    paper = {"source": "s", "model": "m", "dataset": "d", "metric": "ppl", "lower_is_better": True,
             "rows": [{"id": "f", "label": "full", "match": {"method.name": "full"}, "value": None},
                      {"id": "h", "label": "h2o", "match": {"method.name": "h2o"}, "value": None}],
             "claims": [{"claim": "full < h2o", "order": ["f", "h"]}]}
    cfg = fx.config(method="h2o", budget=128, experiment="sweep", paper=paper, task_options={"max_tokens": 1024})
    fx.write_run(str(tmp_path), cfg, {"ppl": 27.0}, fx.ppl_samples([1.0]))
    cfg = fx.config(method="full", experiment="other", task_options={"max_tokens": 4096})
    fx.write_run(str(tmp_path), cfg, {"ppl": 20.0}, fx.ppl_samples([1.0]))

    def judged():
        out = report.write_report(str(tmp_path), str(tmp_path / "out"), json_path=str(tmp_path / "v.json"))
        import json

        return out, json.loads((tmp_path / "v.json").read_text())["sweep"]["claims"][0]
    _, claim = judged()
    assert claim["verdict"] == "not run"  # a 4,096-token full run is not the baseline of 1,024-token runs
    cfg = fx.config(method="full", experiment="other", task_options={"max_tokens": 1024})
    fx.write_run(str(tmp_path), cfg, {"ppl": 25.0}, fx.ppl_samples([1.0]))
    _, claim = judged()
    assert claim["verdict"] == "reproduced" and claim["ours"] == "25 < 27"
    assert "identical run recorded under other" in claim["why"]


# ---------------------------------------------------------------- the kvpress leaderboard figure (task=ruler)
BOARD = {  # method -> {ratio: score}; full at ratio 0 (its ratio is recorded as null)
    "snapkv": {0.25: 40.0, 0.5: 20.0, 0.75: 6.67},
    "knorm": {0.25: 50.0, 0.5: 33.33, 0.75: 10.0},
    "duo_attention": {0.25: 57.33, 0.5: 57.33},
}
FULL_SCORE, FULL_BYTES = 57.33, 176.5 * 2**20


def board_bytes(method: str, ratio: float) -> float:
    """A peak per point that tells methods and ratios apart (duo keeps its retrieval heads whole)."""
    kept = 1 - (ratio / 2 if method == "duo_attention" else ratio)
    return round(FULL_BYTES * (0.2 + 0.8 * kept))


def ruler_board_folder(path, experiment="kvpress_leaderboard"):
    opts = {"lengths": [1024], "tasks": ["niah_single_1", "vt"], "compress_question": False}
    cfg = fx.config(method="full", task="ruler", task_options=opts, experiment=experiment)
    fx.write_run(str(path), cfg, {"score": FULL_SCORE, "peak_kv_bytes": FULL_BYTES}, fx.score_samples([1, 0], "vt"))
    for method, points in BOARD.items():
        for ratio, score in points.items():
            cfg = fx.config(method=method, task="ruler", task_options=opts, experiment=experiment,
                            compression_ratio=ratio, method_options={"decode": "none"})
            metrics = {"score": score, "score_vt": score, "peak_kv_bytes": board_bytes(method, ratio),
                       "kv_kept_fraction": 1 - ratio}
            fx.write_run(str(path), cfg, metrics, fx.score_samples([0, 1], "vt"))
    # a budget run of the same task is not a point of the leaderboard
    cfg = fx.config(method="snapkv", budget=128, task="ruler", task_options=opts, experiment=experiment)
    fx.write_run(str(path), cfg, {"score": 1.0, "peak_kv_bytes": 2**20}, fx.score_samples([0], "vt"))


def test_leaderboard_table_and_figure(tmp_path):
    ruler_board_folder(tmp_path)
    sec = section(tmp_path, "kvpress_leaderboard")
    (board,) = [t for t in sec.tables if "leaderboard" in t.title]
    assert [t.title for t in sec.tables].index(board.title) < [t.title for t in sec.tables].index("runs")
    assert board.columns == ["method", "ratio 0 (no eviction)", "ratio 0.25", "ratio 0.5", "ratio 0.75", "mean"]
    rows = {r[0]: r[1:] for r in board.rows}
    assert list(rows) == ["full", "duo_attention", "knorm", "snapkv"]  # reference first, then by mean, best first
    assert rows["full"] == ["57.33 (176.50)", "", "", "", ""]
    for method, points in BOARD.items():
        cells = dict(zip((0.25, 0.5, 0.75), rows[method][1:4]))
        for ratio, cell in cells.items():
            if ratio in points:
                assert cell == f"{report._fmt(points[ratio])} ({board_bytes(method, ratio) / 2**20:.2f})", cell
            else:
                assert cell == ""
        assert rows[method][4] == report._fmt(round(sum(points.values()) / len(points), 2))
    titles = [t for t, _ in sec.plots]
    figure = "ruler: leaderboard, score vs compression ratio (peak KV MiB beside each point)"
    assert figure in titles
    png = dict(sec.plots)[figure]
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ruler: score per task (the first 8 of 10 runs)" in titles and "LongBench per dataset" not in titles
    # written as a file beside report.md, linked from it, embedded in report.html
    paths = report.write_report(str(tmp_path), str(tmp_path / "out"))
    md = open(paths["markdown"]).read()
    html = open(paths["html"]).read()
    link = re.search(r"\]\((plots/[^)]*leaderboard_score_vs_compression_ratio[^)]*\.png)\)", md).group(1)
    assert (tmp_path / "out" / link).read_bytes() == png
    assert "| full | 57.33 (176.50) |" in md and "<th>ratio 0.25</th>" in html
    assert base64.b64encode(png).decode() in html


def test_threshold_runs_sit_at_their_realized_ratio(tmp_path, monkeypatch):
    """kvzap rows (dms by threshold, no ratio): one line per surrogate on the board's figure, each run at
    1 - kv_kept_fraction, and a table of them (threshold, realized ratio, score, peak)."""
    ruler_board_folder(tmp_path)
    opts = {"lengths": [1024], "tasks": ["niah_single_1", "vt"], "compress_question": False}
    for surrogate, kept, score in (("linear", 0.4, 30.0), ("linear", 0.6, 45.0), ("mlp", 0.4, 35.0)):
        threshold = -3 if kept == 0.4 else -4
        cfg = fx.config(method="dms", task="ruler", task_options=opts, experiment="kvpress_leaderboard",
                        method_options={"base": "kvzap", "base_options": {"surrogate": surrogate},
                                        "threshold": threshold, "decode": "none"})
        fx.write_run(str(tmp_path), cfg, {"score": score, "peak_kv_bytes": 100 * 2**20, "kv_kept_fraction": kept},
                     fx.score_samples([0, 1], "vt"))
    drawn = {}
    inner = report.plots.leaderboard

    def spy(runs, metric):
        for r in runs:
            drawn.setdefault(r["series"], set()).add(report.plots.board_ratio(r))
        return inner(runs, metric)

    monkeypatch.setattr(report.plots, "leaderboard", spy)
    sec = section(tmp_path, "kvpress_leaderboard")
    lines = [k for k in drawn if "linear" in k or "mlp" in k]
    assert len(lines) == 2, drawn  # one line per surrogate, not per threshold
    assert {frozenset(drawn[k]) for k in lines} == {frozenset({0.6, 0.4}), frozenset({0.6})}
    (table,) = [t for t in sec.tables if "threshold runs" in t.title]
    assert table.columns == ["method", "threshold", "realized ratio", "score", "peak KV MiB"]
    assert [r[1:4] for r in table.rows] == [["-4", "0.400", "45"], ["-3", "0.600", "30"], ["-3", "0.600", "35"]]
    assert any("leaderboard" in t for t, _ in sec.plots)


def test_leaderboard_never_sets_an_11_task_score_beside_a_13_task_one(tmp_path):
    """One method's runs scored without two tasks (as RULER without its QA data): a leaderboard of their own."""
    ruler_board_folder(tmp_path)
    for run in os.listdir(tmp_path):
        path = tmp_path / run / "metrics.json"
        if "knorm" in run and path.is_file():
            metrics = json.loads(path.read_text())
            metrics["score_tasks"] = "niah_single_1"
            path.write_text(json.dumps(metrics))
        elif path.is_file():
            metrics = json.loads(path.read_text())
            metrics["score_tasks"] = "niah_single_1,vt"
            path.write_text(json.dumps(metrics))
    sec = section(tmp_path, "kvpress_leaderboard")
    boards = {t.title: t for t in sec.tables if "leaderboard" in t.title}
    assert sorted(boards) == [
        "ruler: leaderboard, score (peak KV MiB) per method and compression ratio [score over 1 task]",
        "ruler: leaderboard, score (peak KV MiB) per method and compression ratio [score over 2 tasks]"]
    assert [r[0] for r in boards[sorted(boards)[0]].rows] == ["knorm"]
    assert "knorm" not in [r[0] for r in boards[sorted(boards)[1]].rows]
    assert sum("leaderboard" in t for t, _ in sec.plots) == 2
    assert any("`score` averages 2 tasks (niah_single_1, vt); 1 task (niah_single_1): runs over different tasks "
               "are never compared" in line for line in sec.lines), sec.lines


def test_leaderboard_needs_ratio_runs(tmp_path):
    """Budget runs only (no compression_ratio): no leaderboard table or figure."""
    sweep_folder(tmp_path)
    sec = section(tmp_path, "budget_sweep")
    assert not any("leaderboard" in t.title for t in sec.tables)
    assert not any("leaderboard" in t for t, _ in sec.plots)


# ---------------------------------------------------------------- run folders that are not what they say
def test_a_run_folder_without_config_is_counted_named_and_left_out(tmp_path):
    """It crashed kvbench-report ("File name too long": a plot name built from every setting, since the folder's
    missing settings made every key vary); now it is left out, counted and named, and plot names are bounded."""
    res = tmp_path / "res"
    for method, budget in (("full", None), ("streaming_llm", 64), ("streaming_llm", 128), ("h2o", 64)):
        rec = fx.write_run(str(res), fx.config(method=method, budget=budget), {"ppl": 30.0 + (budget or 0) / 100,
                           "peak_kv_bytes": (budget or 256) * 46080}, fx.ppl_samples([3.0]))
    os.unlink(os.path.join(rec["run_dir"], "config.yaml"))
    name = os.path.basename(rec["run_dir"])
    proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(res), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"kvbench-report: 1 corrupt run folder(s): {name} (config.yaml is " \
                                           "missing: left out)"
    md = (tmp_path / "o" / "report.md").read_text()
    assert f"1 run folder(s) without a readable config.yaml, left out: {name.replace('_', chr(92) + '_')}" in md
    assert "h2o" not in md.split("## ")[2]  # not in the section's tables
    plots = os.listdir(tmp_path / "o" / "plots")
    assert plots and all(len(p) <= 100 for p in plots)
    from kvbench.reporting.render import plot_file

    long = plot_file("exp", "ppl vs budget [" + ", ".join(f"task.key{i}=value{i}" for i in range(40)) + "]")
    assert len(long) <= 100 and long != plot_file("exp", "ppl vs budget [" + "x" * 400 + "]")


def test_a_planted_run_dir_never_becomes_a_link(tmp_path):
    """metrics.json naming run_dir `javascript:alert(document.domain)` (with a run_id that is no folder) became
    <a href="javascript:..."> when the report was written into the folder it was run from. Links go only to folders
    inside the results folder, by a relative path that no browser reads as a scheme."""
    res = tmp_path / "res"
    good = fx.write_run(str(res), fx.config(), {"ppl": 30.0}, fx.ppl_samples([3.0]))
    evil = fx.write_run(str(res), fx.config(method="h2o", budget=64), {"ppl": 31.0}, fx.ppl_samples([3.0]))
    path = os.path.join(evil["run_dir"], "metrics.json")
    metrics = json.loads(open(path).read())
    metrics.update(run_id="javascript:alert(document.domain)", run_dir="javascript:alert(document.domain)")
    open(path, "w").write(json.dumps(metrics))
    # a folder inside the results folder whose very name looks like a scheme
    named = fx.write_run(str(res), fx.config(method="snapkv", budget=64), {"ppl": 32.0}, fx.ppl_samples([3.0]))
    os.rename(named["run_dir"], res / "javascript:alert(1)")
    for out in (res, tmp_path / "o"):  # --out the results folder itself, run from there: the case that linked
        proc = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", str(res), "--out", str(out)],
                              capture_output=True, text=True, timeout=120, cwd=str(out if out == res else tmp_path),
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.returncode == 0, proc.stderr
        html = (out / "report.html").read_text()
        md = (out / "report.md").read_text()
        hrefs = re.findall(r'href="([^"#]+)"', html)
        assert len(hrefs) == 3 and not any("javascript:alert(document" in h for h in hrefs), hrefs
        assert all(h.startswith(("./", "../")) for h in hrefs), hrefs
        for href in hrefs:  # every link is a run folder inside the results folder
            target = os.path.realpath(os.path.join(out, href))
            assert os.path.isdir(target) and os.path.dirname(target) == str(res), href
        assert re.search(r"\]\((\./|\.\./)[^)]*\)", md)
        assert not re.search(r"\]\(javascript", md)
    from kvbench.store.runs import load_runs

    run = dict(load_runs(str(res))[0], run_dir="javascript:alert(document.domain)")
    assert report.run_link(run, str(res)) is None
    assert report.run_link(dict(run, run_dir="/etc"), str(res)) is None
    assert report.run_link(dict(run, run_dir=good["run_dir"]), str(res)) == f"./{good['run_id']}/"


def test_run_tables_show_the_change_against_full_on_the_same_task(tmp_path):
    for tokens in (1024, 2048):
        opts = {"max_tokens": tokens}
        fx.write_run(str(tmp_path), fx.config(task_options=opts, experiment="vs"),
                     {"ppl": 20.0, "peak_kv_bytes": 4 * 2**20}, fx.ppl_samples([3.0]))
        fx.write_run(str(tmp_path), fx.config(method="h2o", budget=128, task_options=opts, experiment="vs"),
                     {"ppl": 25.0 if tokens == 1024 else 22.0, "peak_kv_bytes": 2**20}, fx.ppl_samples([3.0]))
    # a codec run without a full run of its setting: nothing to compare against
    fx.write_run(str(tmp_path), fx.config(quant={"name": "kivi", "bits": 2}, task_options={"max_tokens": 512},
                                          experiment="vs"), {"ppl": 21.0, "peak_kv_bytes": 2**19}, fx.ppl_samples([3.0]))
    table, = section(tmp_path, "vs").tables
    col = {c: i for i, c in enumerate(table.columns)}
    got = {r[col["setting"]]: (r[col["vs full"]], r[col["peak KV vs full"]]) for r in table.rows}
    assert got["budget=128, method=h2o, quant=none, task.max_tokens=1024"] == ("+5 (+25.0%)", "-75.0%")
    assert got["budget=128, method=h2o, quant=none, task.max_tokens=2048"] == ("+2 (+10.0%)", "-75.0%")
    assert got["budget=none, method=full, quant=none, task.max_tokens=1024"] == ("", "")  # the baseline itself
    assert got["budget=none, method=full, quant=kivi, task.max_tokens=512"] == ("", "")


def test_pareto_line_runs_through_points_of_the_front_only(monkeypatch):
    """The step line's vertical segment ran through a dominated point at the same memory; now the line's vertices
    are exactly the non-dominated points, and no dominated point lies on it."""
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    pts = [("full", None, 30.0, 1), ("h2o", 128, 28.0, 2), ("snapkv", 128, 29.0, 2), ("snapkv", 256, 28.5, 3),
           ("h2o", 256, 26.0, 4), ("streaming_llm", 512, 27.0, 5)]
    runs = [{"cfg": {"method.name": m, "quant.name": "none", "task.name": "perplexity"},
             "metrics": {"method": m, "budget": b, "ppl": y, "peak_kv_bytes": mib * 2**20}} for m, b, y, mib in pts]
    plots.pareto(runs, "ppl")
    (ax,) = figs[0].axes
    (line,) = [ln for ln in ax.lines if ln.get_label() == "Pareto front"]
    vertices = list(zip(line.get_xdata(), line.get_ydata()))
    assert vertices == [(1.0, 30.0), (2.0, 28.0), (4.0, 26.0)]
    assert plots.pareto_front([(1, 5.0), (2, 5.0)], True) == [(1, 5.0)]  # equal metric, more memory: dominated
    assert plots.pareto_front([(1, 5.0), (2, 6.0)], False) == [(1, 5.0), (2, 6.0)]  # higher is better
    for _, _, y, x in pts:
        if (x, y) in vertices:
            continue
        for (x0, y0), (x1, y1) in zip(vertices, vertices[1:]):  # no dominated point on a segment
            if x0 <= x <= x1:
                assert abs(y - (y0 + (y1 - y0) * (x - x0) / (x1 - x0))) > 0.1


def test_leaderboard_peak_labels_never_overlap_where_scores_bunch(monkeypatch):
    """At ratio 0.75 most methods of the smoke board score about 0: their peak labels stack into a tall column that
    widened the y axis after the spacing was chosen from an estimate, so the taller the stack the closer its labels
    came. The spacing is now measured on the finished axes: every column's labels are apart by the same margin."""
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    methods = ["random", "knorm", "snapkv", "expected_attention", "streaming_llm", "tova", "pyramidkv", "lagkv",
               "key_diff", "adakv", "criticalkv", "duo_attention", "kvzip", "h2o"]
    methods += [f"{m}_b" for m in methods]  # a board of 24 lines, nearly all at 0 at ratio 0.75
    runs = [{"cfg": {"method.name": "full", "quant.name": "none", "compression_ratio": None},
             "metrics": {"score": 66.67, "peak_kv_bytes": 40 * 2**20, "evicts": False}}]
    for i, m in enumerate(methods[:plots.MAX_BOARD_SERIES]):
        for ratio, score in ((0.25, 66.67 - (i % 3) * 33.33), (0.5, 33.33 * (i % 2)), (0.75, 0.0)):
            runs.append({"cfg": {"method.name": m, "quant.name": "none", "compression_ratio": ratio},
                         "metrics": {"score": score, "peak_kv_bytes": (40 - 30 * ratio + 0.1 * i) * 2**20}})
    plots.leaderboard(runs, "score")
    (fig,) = figs
    ax = fig.axes[0]
    fig.tight_layout()  # as the PNG is written (plots._png)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    from matplotlib.text import Text

    columns: dict = {}
    for ann in ax.texts:  # the label's own box (an annotation's extent includes its leader line)
        columns.setdefault(round(ann.xyann[0], 6), []).append(Text.get_window_extent(ann, renderer))
    assert sum(len(c) for c in columns.values()) == 1 + 3 * (plots.MAX_BOARD_SERIES - 1)  # full is one of them
    for boxes in columns.values():
        boxes.sort(key=lambda b: b.y0)
        for lower, upper in zip(boxes, boxes[1:]):
            assert upper.y0 - lower.y1 >= 2 * fig.dpi / 72, (lower, upper)  # 2 points apart (1.9 before)
    bottom, top = ax.get_ylim()
    assert all(bottom <= ann.xyann[1] <= top for ann in ax.texts)  # and inside the axes


def test_resident_and_read_bytes_on_two_axes(monkeypatch):
    """Eviction, codecs and retrieval on one figure: peak KV bytes resident (x) against K/V bytes read per decoded
    token (y), each point at its run's measured figures and labelled with the metric; runs without read figures
    are left out."""
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    pts = [("full", 100, 100, 20.0), ("snapkv", 50, 50, 21.0), ("quest", 106, 25, 20.5), ("h2o", 40, None, 22.0)]
    runs = [{"cfg": {"method.name": m, "quant.name": "none", "task.name": "perplexity"},
             "metrics": {"method": m, "ppl": y, "peak_kv_bytes": res * 2**20,
                         "kv_read_bytes_per_token": None if rd is None else rd * 2**20}} for m, res, rd, y in pts]
    assert plots.memory_and_reads(runs, "ppl") == b"png"
    (ax,) = figs[0].axes
    got = sorted((tuple(c.get_offsets()[0]), c.get_label()) for c in ax.collections)
    assert got == [((50.0, 50.0), "snapkv"), ((100.0, 100.0), "full"), ((106.0, 25.0), "quest")]
    assert sorted(t.get_text() for t in ax.texts) == ["20", "20.5", "21"]
    assert plots.memory_and_reads(runs[:1], "ppl") is None  # one point: nothing to set side by side


def test_score_by_turn_plot_one_line_per_method(tmp_path, monkeypatch):
    """scbench runs (score_turn_<k>): a score-by-turn plot per comparable group (task.mode), a line per method and
    setting (task.compress_question is a line, not a group)."""
    from kvbench.reporting import plots

    drawn = []
    real = plots.score_vs_turn

    def spy(runs):
        drawn.append(sorted(plots.series_label(r) for r in runs if len(plots.turn_scores(r)) >= 2))
        return real(runs)

    monkeypatch.setattr(plots, "score_vs_turn", spy)
    for mode in ("multi_turn", "multi_request"):
        for method, budget, turns, cq in (("full", None, [60.0, 60.0, 60.0], False),
                                          ("snapkv", 128, [50.0, 20.0, 10.0], False),
                                          ("snapkv", 128, [55.0, 10.0, 5.0], True)):
            cfg = fx.config(method=method, budget=budget, task="scbench", experiment="scbench_turns",
                            task_options={"mode": mode, "turns": 3, "compress_question": cq})
            metrics = {"score": sum(turns) / 3, **{f"score_turn_{k}": v for k, v in enumerate(turns, 1)}}
            fx.write_run(str(tmp_path), cfg, metrics, fx.score_samples([0.5, 0.5], "scbench_kv"))
    sec = section(tmp_path, "scbench_turns")
    titles = [t for t, _ in sec.plots]
    assert "scbench: score by turn [task.mode=multi_request]" in titles
    assert "scbench: score by turn [task.mode=multi_turn]" in titles, titles
    # one plot per mode, the question compressed or not a line of its own beside full's
    assert len(drawn) == 2 and all(len(d) == 3 for d in drawn), drawn
    assert real([]) is None  # no multi-turn runs: no plot


def test_pareto_sets_held_beside_peak_with_each_point_labelled(monkeypatch):
    """Issue 67 item 4: a method that compresses after prefill peaks at the whole prompt, so the score against
    peak KV and against held KV are both drawn, side by side, each point labelled with its ratio (or budget)."""
    from kvbench.reporting import plots

    figs = _figures(monkeypatch)
    pts = [("full", None, 30.0, 8, 8), ("snapkv", 0.25, 31.0, 8, 6), ("snapkv", 0.5, 33.0, 8, 4),
           ("snapkv", 0.75, 38.0, 8, 2), ("streaming_llm", 0.5, 35.0, 4, 4)]
    runs = [{"cfg": {"method.name": m, "quant.name": "none", "task.name": "ruler", "compression_ratio": r},
             "metrics": {"method": m, "budget": None, "ppl": y, "peak_kv_bytes": peak * 2**20,
                         "held_kv_bytes": held * 2**20}} for m, r, y, peak, held in pts]
    assert plots.pareto(runs, "ppl")
    held_ax, peak_ax = figs[0].axes
    assert "held" in held_ax.get_xlabel() and "peak" in peak_ax.get_xlabel()
    for ax, xs in ((held_ax, [8, 6, 4, 2, 4]), (peak_ax, [8, 8, 8, 8, 4])):
        labels = {(t.xy[0], t.xy[1]): t.get_text() for t in ax.texts}
        assert labels == {(x, y): f"{r:g}" for (_, r, y, _, _), x in zip(pts, xs) if r is not None}
    front = [ln for ln in held_ax.lines if ln.get_label() == "Pareto front"][0]
    assert list(zip(front.get_xdata(), front.get_ydata())) == [(2.0, 38.0), (4.0, 33.0), (6.0, 31.0), (8.0, 30.0)]
    # a record from before held_kv_bytes: the peak panel alone
    figs.clear()
    old = [dict(r, metrics={k: v for k, v in r["metrics"].items() if k != "held_kv_bytes"}) for r in runs]
    assert plots.pareto(old, "ppl") and len(figs[0].axes) == 1 and "peak" in figs[0].axes[0].get_xlabel()


def test_a_ruler_sweep_plots_its_averaged_score_not_its_first_task():
    """Issue 67 item 4: the report plotted `score_niah_single_1` (the first score-like key) for a RULER sweep."""
    from kvbench.reporting.report import metric_for
    from kvbench.reporting.stats import primary_metric

    m = {"score_niah_single_1": 90.0, "score_niah_single_2": 80.0, "score": 85.0, "score_tasks": "a,b"}
    run = {"cfg": {"task.name": "ruler"}, "metrics": m}
    assert metric_for(run, None) == "score" and primary_metric("ruler", m) == "score"
    assert primary_metric("some_new_task", m) == "score"  # an average before its parts, for any task
    assert primary_metric("gsm8k", {"num_problems": 5, "accuracy": 0.4}) == "accuracy"
