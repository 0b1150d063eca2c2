"""`kvbench-report RESULTS_DIR [--experiment NAME] [--out DIR]` (also `python -m kvbench.report`).

Reads the runs of a results folder (metrics.json and config.yaml of each run folder, runs.jsonl for the history)
and writes DIR/report.md (plots as DIR/plots/*.png), DIR/report.html (one self-contained file: plots embedded,
no network) and DIR/runs.csv (every run as one row of a pandas table: metrics, then `cfg.<key>` columns). DIR
defaults to RESULTS_DIR/report.

For each experiment (the `experiment` key of the runs; runs without one are grouped apart), per task:
- a table with one row per run: the setting, the model, the reproduced value of the paper's metric beside the
  published one (the `paper:` block of conf/experiment/NAME.yaml, saved in each run's config.yaml) and the
  difference, KV memory and speed, a link to the run folder, the versions and the git commit;
- plots: the metric against the budget per method, the metric against peak KV bytes with its Pareto front,
  LongBench per-dataset bars, needle heatmaps, throughput against KV memory (task=throughput runs), and, when the
  folder holds runs of several commits, each headline metric per commit (a regression dashboard).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
from typing import Any, Optional

from kvbench.errors import UserError, exit_with
from kvbench.reporting import plots, stats
from kvbench.reporting.render import Section, Table, to_html, to_markdown
from kvbench.reporting.runs import (corrupt_runs, describe, fmt as _fmt, load_runs, pair_key, runs_frame,
                                   setting_of, varying_keys)

NO_EXPERIMENT = "(runs without an experiment)"
def _mib(value: Any) -> str:
    return f"{value / 2**20:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def paper_row(run: dict, paper: Optional[dict]) -> tuple[Optional[dict], bool]:
    """The paper row whose `match` the run's config satisfies (preferring the row of the run's model), and whether
    the run used the paper's model."""
    if not paper:
        return None, False
    path = run["cfg"].get("model.path")
    hits = [row for row in paper.get("rows") or []
            if all(run["cfg"].get(k) == v for k, v in (row.get("match") or {}).items())]
    same = [row for row in hits if row.get("model") and row.get("model") == path]
    if same:
        return same[0], True
    row = hits[0] if hits else None
    models = str(paper.get("model") or "")
    return row, bool(path) and path in [m.strip() for m in models.split(",")]


def metric_for(run: dict, paper: Optional[dict]) -> Optional[str]:
    """The paper's metric when the run has it, else the task's headline metric (e.g. rouge_l of the smoke scale's
    summarization stand-in)."""
    m = run["metrics"]
    wanted = (paper or {}).get("metric")
    if wanted and isinstance(m.get(wanted), (int, float)):
        return wanted
    return stats.primary_metric(run["cfg"].get("task.name") or m.get("task"), m)


def _rel(path: str, out_dir: str) -> str:
    return os.path.relpath(path, out_dir).replace(os.sep, "/") + "/"


def run_table(runs: list[dict], paper: Optional[dict], out_dir: str, title: str) -> tuple[Table, list]:
    keys = [k for k in varying_keys(runs) if k != "task.name"]
    columns = ["setting", "paper row", "model", "metric", "ours", "paper", "diff", "peak KV MiB", "decode tok/s",
               "status", "run", "versions", "commit"]
    rows, matched = [], []
    for run in sorted(runs, key=lambda r: setting_of(r, keys)):
        m = run["metrics"]
        metric = metric_for(run, paper)
        ours = m.get(metric) if metric else None
        row, same_model = paper_row(run, paper)
        matched.append((run, row))
        published = row.get("value") if row else None
        comparable = (published is not None and isinstance(ours, (int, float)) and metric == (paper or {}).get("metric"))
        diff = ""
        if comparable:
            diff = f"{ours - published:+.4g}" + ("" if same_model else " (other model)")
        elif row is not None and published is None:
            diff = "unknown"
        elif row is not None and metric != (paper or {}).get("metric"):
            diff = f"n/a ({metric} vs {(paper or {}).get('metric')})"
        versions = " ".join(f"{k} {m[k]}" for k in ("kvbench", "torch", "transformers") if m.get(k))
        commit = str(m.get("git_commit") or "")[:10]
        rows.append([setting_of(run, keys), row.get("label", "") if row else "", str(m.get("model") or ""),
                     metric or "", _fmt(ours), _fmt(published), diff, _mib(m.get("peak_kv_bytes")),
                     _fmt(m.get("decode_tokens_per_s"), 3), str(m.get("status")),
                     (m.get("run_id") or "run", _rel(run["run_dir"], out_dir)), versions, commit])
    return Table(title, columns, rows, numeric=(4, 5, 7, 8)), matched


def history_plots(history: list[dict], metrics: list[str], labels: dict[str, str]) -> list[tuple]:
    """One plot per metric across the commits of the history (runs.jsonl), one line per setting (labels: pair key
    -> name); nothing unless some setting ran at two commits or more."""
    per_setting: dict[str, set] = {}
    for run in history:
        per_setting.setdefault(pair_key(run), set()).add(run["metrics"].get("git_commit"))
    if max((len(c - {None}) for c in per_setting.values()), default=0) < 2:
        return []
    commits: dict[str, str] = {}
    for run in history:
        c = run["metrics"].get("git_commit")
        t = str(run["metrics"].get("finished_at") or "")
        if c and (c not in commits or t < commits[c]):
            commits[c] = t
    if len(commits) < 2:
        return []
    order = sorted(commits, key=lambda c: commits[c])
    out = []
    for metric in metrics:
        points: dict[str, list] = {}
        for run in history:
            v, c = run["metrics"].get(metric), run["metrics"].get("git_commit")
            if c and isinstance(v, (int, float)) and not isinstance(v, bool) and run["metrics"].get("status") == "ok":
                key = pair_key(run)
                points.setdefault(labels.get(key) or describe(run), []).append((c, float(v)))
        png = plots.history(points, order, metric)
        if png:
            out.append((f"history: {metric} per commit", png))
    return out


def experiment_section(name: str, runs: list[dict], history: list[dict], out_dir: str) -> Section:
    paper = next((r["paper"] for r in reversed(runs) if r.get("paper")), None)
    sec = Section(title=name)
    if paper:
        sec.lines.append(f"Paper: {paper.get('source')}")
        sec.lines.append(f"Paper's model: {paper.get('model')}; data: {paper.get('dataset')}; metric: "
                         f"`{paper.get('metric')}` ({'lower' if paper.get('lower_is_better') else 'higher'} is better)"
                         + (f"; setting: {paper.get('setting')}" if paper.get("setting") else ""))
        if paper.get("note"):
            sec.lines.append(str(paper["note"]))
    models = sorted({str(r["metrics"].get("model")) for r in runs})
    sec.lines.append(f"{len(runs)} runs; models: {', '.join(models)}. Rows on another model than the paper's "
                     "(smoke scale) show the paper's value for orientation only.")
    tasks = sorted({str(r["cfg"].get("task.name") or r["metrics"].get("task")) for r in runs})
    headline = []
    for task in tasks:
        mine = [r for r in runs if str(r["cfg"].get("task.name") or r["metrics"].get("task")) == task]
        line_keys = [k for k in varying_keys(mine) if k not in ("budget", "task.name")]
        for r in mine:  # one plot line per method and per other swept setting of this task (budget is the x axis)
            r["series"] = setting_of(r, line_keys) if line_keys else describe(r)
        table, matched = run_table(mine, paper, out_dir, f"task {task}" if len(tasks) > 1 else "")
        sec.tables.append(table)
        ok = [r for r in mine if r["metrics"].get("status") == "ok"]
        metric = next((metric_for(r, paper) for r in ok if metric_for(r, paper)), None)
        if metric:
            headline.append(metric)
            swept = varying_keys(ok)
            numeric = [k for k in swept if k != "budget" and all(
                isinstance(r["cfg"].get(k), (int, float)) and not isinstance(r["cfg"].get(k), bool) for r in ok)]
            other_x = []
            for k in numeric[:2]:  # e.g. method.sinks, runtime.block_size: one line per setting of the other keys
                rest = [k2 for k2 in swept if k2 not in (k, "task.name")]
                relabeled = [dict(r, series=setting_of(r, rest) if rest else task) for r in ok]
                other_x.append((f"{task}: {metric} vs {k}", plots.metric_vs_budget(relabeled, metric, k)))
            for title, png in ((f"{task}: {metric} vs budget", plots.metric_vs_budget(ok, metric)), *other_x,
                               (f"{task}: {metric} vs KV memory (Pareto front)", plots.pareto(ok, metric))):
                if png:
                    sec.plots.append((title, png))
        ok_pairs = [(r, row) for r, row in matched if r["metrics"].get("status") == "ok"]
        bars = plots.longbench_bars([r for r, _ in ok_pairs], [row for _, row in ok_pairs])
        for title, png in (("LongBench per dataset", bars),
                           (f"{task}: needle accuracy per cell", plots.needle_heatmaps(ok)),
                           ("throughput vs KV memory", plots.throughput(ok))):
            if png:
                sec.plots.append((title, png))
        if any(isinstance(r["metrics"].get("decode_tokens_per_s"), (int, float)) for r in ok) and task != "throughput":
            png = plots.metric_vs_budget(ok, "decode_tokens_per_s")
            if png:
                sec.plots.append((f"{task}: decode tokens/s vs budget", png))
    all_keys = varying_keys(runs)
    labels = {pair_key(r): setting_of(r, all_keys) for r in runs}
    mine_hist = [r for r in history if pair_key(r) in labels]
    sec.plots += history_plots(mine_hist, list(dict.fromkeys(headline + ["decode_tokens_per_s", "peak_kv_bytes"])),
                               labels)
    return sec


def build(results_dir: str, experiment: Optional[str] = None) -> tuple[list[str], list[tuple]]:
    """The experiments to report and, for each, (name, its latest runs, the whole history of runs.jsonl)."""
    if not os.path.isdir(results_dir):
        raise UserError(f"no results folder {results_dir!r}")
    runs = load_runs(results_dir)
    if not runs:
        raise UserError(f"no runs in {results_dir!r} (run folders with a metrics.json)")
    names = sorted({r["experiment"] or NO_EXPERIMENT for r in runs})
    if experiment is not None:
        if experiment not in names:
            raise UserError(f"unknown experiment {experiment!r} in {results_dir}: choices are {', '.join(names)}")
        names = [experiment]
    history = load_runs(results_dir, history=True)
    return names, [(name, [r for r in runs if (r["experiment"] or NO_EXPERIMENT) == name], history) for name in names]


def write_report(results_dir: str, out_dir: Optional[str] = None, experiment: Optional[str] = None) -> dict:
    """Write report.md (+ plots/) and report.html; returns their paths."""
    results_dir = os.path.abspath(results_dir)
    out_dir = os.path.abspath(out_dir or os.path.join(results_dir, "report"))
    names, groups = build(results_dir, experiment)
    os.makedirs(out_dir, exist_ok=True)
    sections = [experiment_section(name, runs, history, out_dir) for name, runs, history in groups]
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    intro = [f"Results folder: `{results_dir}`; {sum(len(g[1]) for g in groups)} runs; generated {now}.",
             "Each table row links its run folder (config.yaml, metrics.json, samples.jsonl). `diff` = ours - paper."]
    title = "kvbench report" + (f": {experiment}" if experiment else "")
    from kvbench.results import atomic_write_text

    md_path, html_path = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.html")
    atomic_write_text(md_path, to_markdown(title, intro, sections, out_dir))
    atomic_write_text(html_path, to_html(title, intro, sections))
    csv_path = os.path.join(out_dir, "runs.csv")  # every run of the report as one flat pandas table
    frame = runs_frame([r for _, runs, _ in groups for r in runs])
    atomic_write_text(csv_path, frame.to_csv(index=False))
    return {"markdown": md_path, "html": html_path, "csv": csv_path, "experiments": names}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvbench-report", description=__doc__.split("\n\n")[1])
    p.add_argument("results_dir", help="a results folder (results_dir of the runs)")
    p.add_argument("--experiment", help="only this experiment (the runs' `experiment` key)")
    p.add_argument("--out", help="output folder (default: RESULTS_DIR/report)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("kvbench-report needs matplotlib: pip install 'kvbench[report]'") from None
    paths = write_report(args.results_dir, args.out, args.experiment)
    print(f"kvbench-report: wrote {paths['markdown']} and {paths['html']} "
          f"({len(paths['experiments'])} experiments: {', '.join(paths['experiments'])})")
    corrupt = corrupt_runs(args.results_dir)
    if corrupt:  # unreadable metrics.json: left out; unreadable config.yaml: shown without its settings
        print(f"kvbench-report: {len(corrupt)} corrupt run folder(s): " + "; ".join(
            f"{name} ({why}: {'left out' if why.startswith('metrics.json') else 'shown without its config'})"
            for name, why in corrupt))
    return 0


def cli() -> None:
    """Console entry point: exit 2 on bad input (one line on stderr)."""
    exit_with(main)


if __name__ == "__main__":
    cli()
