"""`kvbench-report RESULTS_DIR [--experiment NAME] [--out DIR] [--json FILE]` (also `python -m kvbench.reporting.report`).

Reads the runs of a results folder (metrics.json and config.yaml of each run folder, runs.jsonl for the history)
and writes DIR/report.md (plots as DIR/plots/*.png), DIR/report.html (one self-contained file: plots embedded,
no network), DIR/runs.csv (every run as one row of a pandas table: metrics, then `cfg.<key>` columns) and, with
--json, the verdicts; prints the verdicts. DIR defaults to RESULTS_DIR/report.

For each experiment (the `experiment` key of the runs; runs without one are grouped apart):
- the verdict on the paper's claims (the `paper:` block of conf/experiment/NAME.yaml, saved in each run's
  config.yaml; kvbench.reporting.claims): per claim our figure, its 95% bootstrap interval and the items resampled
  beside the paper's figure, and reproduced / not reproduced / inconclusive / not run; for the experiment not
  reproduced when any claim is refuted, reproduced only when every claim is, else inconclusive, with the scale
  (model) and the samples per run beside it;
- per task, a table with one row per run: the setting, the paper row it matches, the model and dtype, our value
  and its change against the `full` run of the same model, task and runtime settings (with the paired bootstrap
  95% interval of the change over the samples both scored, kvbench.reporting.pair), and, only on the paper's
  model and data and in its metric, the published one and the difference; peak KV memory and its change against
  `full`, speed, a link to the run folder (only to folders inside the results folder, by relative path), the
  versions and the git commit (columns empty for every run are left out);
Run folders without a readable config.yaml are left out of the sections, counted and named.
- plots, each over comparable runs only (same model, task and runtime settings; one colour per method): the metric
  against the budget per method, against peak KV bytes with its Pareto front, against another swept number (sinks,
  block size), LongBench per-dataset bars, needle heatmaps, throughput against KV memory (task=throughput runs),
  and, when the folder holds runs of several commits, each headline metric per commit (a regression dashboard).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
from typing import Any, Optional

from kvbench.console import exit_with, visible
from kvbench.errors import UserError
from kvbench.reporting import claims, plots, stats
from kvbench.reporting.pair import change_interval
from kvbench.reporting.render import Section, Table, to_html, to_markdown
from kvbench.reporting.runs import describe, fmt as _fmt, pair_key, setting_of, setting_sort_key, varying_keys
from kvbench.store.files import atomic_write_text
from kvbench.store.runs import corrupt_runs, load_runs, samples_of
from kvbench.store.table import runs_frame

NO_EXPERIMENT = "(runs without an experiment)"
def _mib(value: Any) -> str:
    return f"{value / 2**20:.2f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else ""


def paper_row(run: dict, paper: Optional[dict]) -> tuple[Optional[dict], bool]:
    """The paper row whose `match` the run's config satisfies (preferring the row of the run's model), and whether
    the run is on the paper's model and data (then, and only then, absolute values are compared)."""
    if not paper:
        return None, False
    path = run["cfg"].get("model.path")
    hits = [row for row in paper.get("rows") or []
            if all(run["cfg"].get(k) == v for k, v in (row.get("match") or {}).items())]
    same = [row for row in hits if row.get("model") and row.get("model") == path]
    models = [m.strip() for m in str(paper.get("model") or "").split(",")]
    data = all(run["cfg"].get(k) == v for k, v in (paper.get("data_match") or {}).items())
    if same:
        return same[0], data
    row = hits[0] if hits else None
    return row, bool(path) and path in models and data and not (row or {}).get("model")


def metric_for(run: dict, paper: Optional[dict]) -> Optional[str]:
    """The paper's metric when the run has it, else the task's headline metric (e.g. rouge_l of the smoke scale's
    summarization stand-in)."""
    m = run["metrics"]
    wanted = (paper or {}).get("metric")
    if wanted and isinstance(m.get(wanted), (int, float)):
        return wanted
    return stats.primary_metric(run["cfg"].get("task.name") or m.get("task"), m)


def run_link(run: dict, out_dir: str) -> Optional[str]:
    """The relative link from the report to the run's folder, only when that folder is a folder inside the results
    folder the run was read from (a planted run_dir such as `javascript:...` or `/etc` gets no link); always a path
    (`./name/` or `../name/`), never something a browser could read as a scheme."""
    results = os.path.realpath(run.get("results_dir") or "")
    folder = os.path.realpath(run["run_dir"])
    if not run.get("results_dir") or not os.path.isdir(folder) or folder == results or \
            os.path.commonpath([results, folder]) != results:
        return None
    rel = os.path.relpath(folder, out_dir).replace(os.sep, "/") + "/"
    return rel if rel.startswith("../") else "./" + rel


def _change(value: Any, base: Any, percent_only: bool = False) -> str:
    """value against base: "+1.23 (+4.5%)", or the percentage alone; "" without two numbers."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v for v in (value, base)):
        return ""
    pct = f"{(value - base) / abs(base) * 100:+.1f}%" if base else ""
    if percent_only:
        return pct
    return f"{value - base:+.4g}" + (f" ({pct})" if pct else "")


def change_vs_full(metric: str, run: dict, full: Optional[dict]) -> str:
    """The run's metric against its full run's: "+1.23 (+4.5%) [-0.8, +3.1]", the bracket the paired bootstrap 95%
    interval of the change over the samples both scored (kvbench.reporting.pair), when they scored the same ones."""
    if full is None:
        return ""
    text = _change(run["metrics"].get(metric), full["metrics"].get(metric))
    interval = change_interval(metric, run, full) if text else None
    return text + (f" [{interval[0]:+.3g}, {interval[1]:+.3g}]" if interval else "")


def full_run_of(run: dict, runs: list[dict]) -> Optional[dict]:
    """The `full` run (no eviction, no codec, finished well) with the run's model, task, runtime settings and seed:
    the baseline its change is measured against; None for a full run itself or when there is none."""
    if _is_full(run):
        return None
    mine = claims.signature(run), stats.score_tasks(run["metrics"])
    return next((r for r in runs if _is_full(r) and r["metrics"].get("status") == "ok"
                 and (claims.signature(r), stats.score_tasks(r["metrics"])) == mine), None)


def _is_full(run: dict) -> bool:
    return run["cfg"].get("method.name") == "full" and run["cfg"].get("quant.name") in (None, "none", "full")


def run_table(runs: list[dict], paper: Optional[dict], out_dir: str, title: str) -> tuple[Table, list]:
    """One row per run: its setting, the paper row it matches, our value and, only on the paper's model and data
    and in the paper's metric, the published value and the difference. Empty columns are left out when rendered."""
    keys = [k for k in varying_keys(runs) if k != "task.name"]
    columns = ["setting", "paper row", "model (dtype)", "metric", "ours", "vs full", "paper", "diff", "peak KV MiB",
               "peak KV vs full", "KV read MiB/token", "read vs full", "decode tok/s", "status", "run", "versions",
               "commit"]
    rows, matched = [], []
    paper_metric = (paper or {}).get("metric")
    for run in sorted(runs, key=lambda r: setting_sort_key(r, keys)):
        m = run["metrics"]
        metric = metric_for(run, paper)
        ours = m.get(metric) if metric else None
        row, same = paper_row(run, paper)
        matched.append((run, row if same else None))  # published per-dataset ticks only on the paper's model and data
        published = row.get("value") if row else None
        shown, diff = "", ""
        if row is not None and metric != paper_metric:
            diff = f"not compared: paper reports {paper_metric}"
        elif row is not None and published is None:
            diff = ""  # unknown: the block's note says so; nothing to compare
        elif row is not None and not same:  # the published value belongs to another model or data: not shown here
            diff = "not compared: other model or data (see the claims)"
        elif row is not None and isinstance(ours, (int, float)) and not isinstance(ours, bool):
            shown, diff = _fmt(published), f"{ours - published:+.4g}"
        versions = " ".join(f"{k} {m[k]}" for k in ("kvbench", "torch", "transformers") if m.get(k))
        commit = str(m.get("git_commit") or "")[:10]
        model = str(m.get("model") or "") + (f" ({m['dtype']})" if m.get("dtype") else "")
        full = full_run_of(run, runs)
        fm = full["metrics"] if full else {}
        rows.append([setting_of(run, keys), row.get("label", "") if row else "", model,
                     metric or "", _fmt(ours), change_vs_full(metric, run, full) if metric else "", shown, diff,
                     _mib(m.get("peak_kv_bytes")), _change(m.get("peak_kv_bytes"), fm.get("peak_kv_bytes"), True),
                     _mib(m.get("kv_read_bytes_per_token")),
                     _change(m.get("kv_read_bytes_per_token"), fm.get("kv_read_bytes_per_token"), True),
                     _fmt(m.get("decode_tokens_per_s"), 3), str(m.get("status")),
                     (m.get("run_id") or "run", run_link(run, out_dir)), versions, commit])
    return Table(title, columns, rows, numeric=(4, 5, 8, 9, 10, 11, 12)), matched


def _series_of(runs: list[dict]) -> list[dict]:
    """The runs with their line's name: the method, plus the settings that vary among runs of one method (not the
    budget, ratio or threshold: the x axis)."""
    keys = [k for k in varying_keys(runs) if k not in ("budget", "compression_ratio", "method.threshold", "task.name")]
    if keys == ["method.name"]:
        return [dict(r, series=plots.method_key(r)) for r in runs]
    return [dict(r, series=setting_of(r, keys) if keys else plots.method_key(r)) for r in runs]


def leaderboard_table(runs: list[dict], metric: str, title: str) -> Optional[Table]:
    """kvpress's leaderboard as a table: one row per method (line of the figure), one column per compression
    ratio, each cell `score (peak KV MiB)`; methods that do not evict (full, codecs) in the ratio-0 column; rows
    by their mean over the ratios, best first. None when no run has a ratio. Pass comparable ok runs."""
    series = _series_of(runs)
    cells: dict[str, dict[float, tuple]] = {}
    for r in series:
        value = r["metrics"].get(metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        ratio = plots.ratio_of(r)
        if ratio is None and not plots._flat([r]):
            continue  # an evicting run with a budget: not a point of the leaderboard
        cells.setdefault(r["series"], {})[0.0 if ratio is None else ratio] = (value, r["metrics"].get("peak_kv_bytes"))
    if not any(plots.ratio_of(r) is not None for r in series):
        return None
    ratios = sorted({x for row in cells.values() for x in row})
    low = stats.lower_is_better(metric)

    def mean(row: dict) -> float:
        vals = [v for v, _ in row.values()]
        return sum(vals) / len(vals)

    order = sorted(cells, key=lambda name: (0.0 not in cells[name] or any(x > 0 for x in cells[name]),
                                            mean(cells[name]) if low else -mean(cells[name]), name))
    columns = ["method"] + [f"ratio {x:g}" + (" (no eviction)" if x == 0 else "") for x in ratios] + ["mean"]
    rows = []
    for name in order:
        row = cells[name]
        rows.append([name] + [f"{_fmt(row[x][0])} ({_mib(row[x][1]) or '-'})" if x in row else "" for x in ratios]
                    + [_fmt(round(mean(row), 2)) if any(x > 0 for x in row) else ""])
    return Table(title, columns, rows, numeric=tuple(range(1, len(columns))))


def threshold_table(runs: list[dict], metric: str, title: str) -> Optional[Table]:
    """The threshold runs (method.threshold: kvpress's kvzap rows) one row each: their line, threshold, realized
    compression ratio (1 - kv_kept_fraction), the metric and peak KV MiB, by line then threshold. None without
    one."""
    rows = []
    for r in _series_of(runs):
        realized, value = plots.realized_ratio(r), r["metrics"].get(metric)
        if realized is None or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        peak = r["metrics"].get("peak_kv_bytes")
        rows.append((r["series"], float(r["cfg"]["method.threshold"]), realized, value,
                     "" if not isinstance(peak, (int, float)) else f"{peak / 2**20:.1f}"))
    if not rows:
        return None
    rows.sort(key=lambda t: (t[0], t[1]))
    return Table(title, ["method", "threshold", "realized ratio", metric, "peak KV MiB"],
                 [[a, f"{b:g}", f"{c:.3f}", _fmt(d), e] for a, b, c, d, e in rows])


def leaderboard_parts(task: str, ok: list[dict], metric: Optional[str]) -> tuple[list[Table], list[tuple]]:
    """The leaderboard table and figure of one task's ok runs, per comparable group, where runs have a
    compression_ratio (kvpress's protocol: task=ruler)."""
    tables, figures = [], []
    if not metric or not any(plots.board_ratio(r) is not None for r in ok):
        return tables, figures
    for group, runs in task_set_groups(comparable_groups(ok), metric):
        if not any(plots.board_ratio(r) is not None for r in runs):
            continue
        name = f"{task}: leaderboard, {metric} (peak KV MiB) per method and compression ratio"
        table = leaderboard_table(runs, metric, _titled(name, group))
        if table is not None:
            tables.append(table)
        table = threshold_table(runs, metric, _titled(f"{task}: threshold runs, {metric} against the realized "
                                                      "compression ratio", group))
        if table is not None:
            tables.append(table)
        png = plots.leaderboard(_series_of(runs), metric)
        if png:
            figures.append((_titled(f"{task}: leaderboard, {metric} vs compression ratio (peak KV MiB beside each "
                                    "point)", group), png))
    return tables, figures


def task_set_groups(groups: list[tuple[str, list[dict]]], metric: str) -> list[tuple[str, list[dict]]]:
    """Each group split by the tasks its `score` averages (RULER without its QA data averages 11 tasks, not 13):
    a score is never set beside one over other tasks. The group name says the task count when it splits."""
    if not stats.averages_tasks(metric):
        return groups
    out = []
    for group, runs in groups:
        sets: dict = {}
        for run in runs:
            sets.setdefault(stats.score_tasks(run["metrics"]), []).append(run)
        if len(sets) == 1:
            out.append((group, runs))
            continue
        for tasks, mine in sorted(sets.items(), key=lambda kv: (-len(kv[0] or ()), kv[0] or ())):
            label = (f"{metric} over {len(tasks)} task" + ("s" if len(tasks) != 1 else "")) if tasks else \
                f"{metric} over unrecorded tasks"
            out.append((", ".join(x for x in (group, label) if x), mine))
    return out


def claims_table(verdicts: list[claims.Verdict]) -> Table:
    rows = [[v.claim, v.metric, v.expected, v.ours, v.interval, v.items, v.paper, v.verdict, v.why] for v in verdicts]
    return Table("claims of the paper, judged on these runs (95% bootstrap intervals)",
                 ["claim", "metric", "relation", "ours", "95% interval", "items", "paper", "verdict", "why"], rows,
                 keep=tuple(range(8)))


def scale_text(runs: list[dict], paper: dict) -> str:
    """The scale a verdict was reached at: the models (the paper's or not) and how many samples (and perplexity
    windows) each run scored, so that a one-sample smoke verdict reads as what it is."""
    paper_models = {m.strip() for m in str(paper.get("model") or "").split(",") if m.strip()}
    models = sorted({str(r["metrics"].get("model") or r["cfg"].get("model.path")) for r in runs})
    on_paper = bool(runs) and all(r["cfg"].get("model.path") in paper_models for r in runs)
    scale = "scale: the paper's model" if on_paper else \
        f"scale: {', '.join(models)}, not the paper's model ({paper.get('model')})"
    ok = [r for r in runs if r["metrics"].get("status") == "ok"]
    counts = [r["metrics"].get("num_samples") for r in ok if isinstance(r["metrics"].get("num_samples"), int)]
    units = []
    for r in ok:
        metric = metric_for(r, paper)
        samples = samples_of(r) or []
        if metric and samples and stats.sample_unit(metric, samples) == "windows":
            units.append(stats.sample_count(metric, samples))

    def span(xs: list[int]) -> str:
        return str(xs[0]) if min(xs) == max(xs) else f"{min(xs)}-{max(xs)}"
    if not counts:
        return scale
    per = f"{span(sorted(counts))} sample" + ("s" if max(counts) != 1 else "")
    if units:
        per += f" ({span(sorted(units))} perplexity windows)"
    return f"{scale}; {len(ok)} runs of {per} each"


def history_plots(history: list[dict], metrics: list[str], labels: dict[str, str],
                  methods: Optional[dict[str, str]] = None) -> list[tuple]:
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
        png = plots.history(points, order, metric, methods)
        if png:
            out.append((f"history: {metric} per commit", png))
    return out


# Settings that make runs incomparable in one plot when they differ (model, data, runtime): plots draw lines only
# among runs equal in these (the method's own options and the budget are what a plot compares).
COMPARABLE_SECTIONS = ("model.", "task.", "runtime.")


def comparable_groups(runs: list[dict], free: tuple = ()) -> list[tuple[str, list[dict]]]:
    """The runs split by the model / task / runtime settings (and seed) that vary among them, except `free` keys
    (a plot's x axis); each group named by its setting ("" for one group)."""
    keys = [k for k in varying_keys(runs) if (k.startswith(COMPARABLE_SECTIONS) or k == "seed")
            and k not in free and k != "task.name"]
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(setting_of(run, keys) if keys else "", []).append(run)
    return sorted(groups.items())


def _titled(title: str, group: str) -> str:
    return f"{title} [{group}]" if group else title


def task_plots(task: str, ok: list[dict], metric: Optional[str], matched: list) -> list[tuple]:
    """The plots of one task's ok runs: per comparable group, the metric against the budget and against KV memory
    (and decode speed); against each other swept numeric setting; LongBench bars, needle heatmaps, throughput."""
    out: list[tuple] = []
    if metric:
        for group, runs in task_set_groups(comparable_groups(ok), metric):
            line_keys = [k for k in varying_keys(runs) if k not in ("budget", "compression_ratio", "task.name")]
            series = [dict(r, series=setting_of(r, line_keys) if line_keys else describe(r)) for r in runs]
            for title, png in ((f"{task}: {metric} vs budget", plots.metric_vs_budget(series, metric)),
                               (f"{task}: {metric} vs KV memory (Pareto front)", plots.pareto(series, metric)),
                               (f"{task}: KV resident vs KV read per token", plots.memory_and_reads(series, metric))):
                if png:
                    out.append((_titled(title, group), png))
        swept = varying_keys(ok)
        numeric = [k for k in swept if k != "budget" and all(
            isinstance(r["cfg"].get(k), (int, float)) and not isinstance(r["cfg"].get(k), bool) for r in ok)]
        for k in numeric[:2]:  # e.g. method.sinks, runtime.block_size: one line per setting of the other keys
            for group, runs in comparable_groups(ok, free=(k,)):
                rest = [k2 for k2 in varying_keys(runs) if k2 not in (k, "task.name") and not
                        (k.startswith("method.") and k2.startswith("method.") and k2 != "method.name")]
                relabeled = [dict(r, series=setting_of(r, rest) if rest else task) for r in runs]
                png = plots.metric_vs_budget(relabeled, metric, k)
                if png:
                    out.append((_titled(f"{task}: {metric} vs {k}", group), png))
    # multi-turn tasks (scbench): score against turn, a line per method; whether the question was compressed is a
    # line of its own beside full's, not a separate plot
    for group, runs in comparable_groups(ok, free=("task.compress_question",)):
        line_keys = [k for k in varying_keys(runs) if k != "task.name"]
        series = [dict(r, series=setting_of(r, line_keys) if line_keys else describe(r)) for r in runs]
        png = plots.score_vs_turn(series)
        if png:
            out.append((_titled(f"{task}: score by turn", group), png))
    ok_pairs = [(r, row) for r, row in matched if r["metrics"].get("status") == "ok"]
    # per-dataset bars (score_<dataset>): LongBench's datasets, or the tasks of another multi-part task (RULER)
    bars_title = "LongBench per dataset" if task.startswith("longbench") else f"{task}: score per task" + (
        f" (the first 8 of {len(ok_pairs)} runs)" if len(ok_pairs) > 8 else "")
    bars = plots.longbench_bars([r for r, _ in ok_pairs], [row for _, row in ok_pairs], bars_title)
    for title, png in ((bars_title, bars),
                       (f"{task}: needle accuracy per cell", plots.needle_heatmaps(ok)),
                       ("throughput vs KV memory", plots.throughput(ok)),
                       (f"{task}: KV over generated tokens", plots.kv_over_generation(ok)),
                       (f"{task}: KV pool usage over time", plots.pool_usage(ok)),
                       (f"{task}: speculative decoding, acceptance vs draft budget",
                        plots.acceptance_vs_draft_budget(ok))):
        if png:
            out.append((title, png))
    if task != "throughput" and any(isinstance(r["metrics"].get("decode_tokens_per_s"), (int, float)) for r in ok):
        for group, runs in comparable_groups(ok):
            line_keys = [k for k in varying_keys(runs) if k not in ("budget", "compression_ratio", "task.name")]
            series = [dict(r, series=setting_of(r, line_keys) if line_keys else describe(r)) for r in runs]
            png = plots.metric_vs_budget(series, "decode_tokens_per_s")
            if png:
                out.append((_titled(f"{task}: decode tokens/s vs budget", group), png))
    return out


def paper_of(name: str, runs: list[dict]) -> Optional[dict]:
    """The experiment's paper block as the newest run recorded it, checked (a bad block: one-line UserError)."""
    latest = sorted(runs, key=lambda r: str(r["metrics"].get("finished_at") or ""))
    paper = next((r["paper"] for r in reversed(latest) if r.get("paper") is not None), None)
    return None if paper is None else claims.validate_paper(paper, name)


def experiment_section(name: str, runs: list[dict], history: list[dict], out_dir: str,
                       others: Optional[list[dict]] = None) -> Section:
    """One experiment: its claims' verdicts, its runs per task, its plots (others: the folder's other runs, which
    a claim may use for a row whose identical run another experiment recorded)."""
    paper = paper_of(name, runs)
    sec = Section(title=name)
    verdicts = [claims.judge(c, paper, runs, others) for c in (paper or {}).get("claims") or []]
    sec.verdicts = verdicts
    if paper:
        verdict, summary = claims.experiment_verdict(verdicts)
        sec.verdict = (verdict, f"{summary}; {scale_text(runs, paper)}")
        sec.lines.append(f"Paper: {paper.get('source')}")
        sec.lines.append(f"Paper's model: {paper.get('model')}; data: {paper.get('dataset')}; metric: "
                         f"`{paper.get('metric')}` ({'lower' if paper.get('lower_is_better') else 'higher'} is better)"
                         + (f"; setting: {paper.get('setting')}" if paper.get("setting") else ""))
        if paper.get("note"):
            sec.lines.append(str(paper["note"]))
        if verdicts:
            sec.tables.append(claims_table(verdicts))
    models = sorted({str(r["metrics"].get("model")) for r in runs})
    sec.lines.append(f"{len(runs)} runs; models: {', '.join(models)}. Claims compare relations between our own rows "
                     "(ratios, orderings); absolute values are compared with the paper's only for runs on the "
                     "paper's model and data.")
    tasks = sorted({str(r["cfg"].get("task.name") or r["metrics"].get("task")) for r in runs})
    headline = []
    for task in tasks:
        mine = [r for r in runs if str(r["cfg"].get("task.name") or r["metrics"].get("task")) == task]
        table, matched = run_table(mine, paper, out_dir, f"task {task}" if len(tasks) > 1 else "runs")
        ok = [r for r in mine if r["metrics"].get("status") == "ok"]
        metric = next((metric_for(r, paper) for r in ok if metric_for(r, paper)), None)
        sets = {stats.score_tasks(r["metrics"]) for r in ok} - {None}
        if metric and stats.averages_tasks(metric) and sets:
            sec.lines.append(f"task {task}: `{metric}` averages " + "; ".join(
                f"{len(s)} task{'s' if len(s) != 1 else ''} ({', '.join(s)})" for s in sorted(sets, key=len, reverse=True))
                + (": runs over different tasks are never compared or drawn together" if len(sets) > 1 else ""))
        if metric:
            headline.append(metric)
        board_tables, board_plots = leaderboard_parts(task, ok, metric)
        sec.tables += board_tables + [table]  # the leaderboard's summary before the run-by-run table
        sec.plots += board_plots
        sec.plots += task_plots(task, ok, metric, matched)
    all_keys = varying_keys(runs)
    labels = {pair_key(r): setting_of(r, all_keys) for r in runs}
    methods = {setting_of(r, all_keys): plots.method_key(r) for r in runs}
    mine_hist = [r for r in history if pair_key(r) in labels]
    sec.plots += history_plots(mine_hist, list(dict.fromkeys(headline + ["decode_tokens_per_s", "peak_kv_bytes"])),
                               labels, methods)
    return sec


def build(results_dir: str, experiment: Optional[str] = None) -> tuple[list[str], list[tuple]]:
    """The experiments to report and, for each, (name, its latest runs, the whole history of runs.jsonl). Every
    experiment's paper block is checked here, before anything is written."""
    if not os.path.isdir(results_dir):
        raise UserError(f"no results folder {results_dir!r}")
    loaded = load_runs(results_dir, repair=False, warn_corrupt=False)
    runs = [r for r in loaded if r["config"]]
    if not runs:
        raise UserError(f"no runs in {results_dir!r} (run folders with a metrics.json"
                        + (f" and a readable config.yaml: {len(loaded)} without one)" if loaded else ")"))
    names = sorted({r["experiment"] or NO_EXPERIMENT for r in runs})
    if experiment is not None:
        if experiment not in names:
            raise UserError(f"unknown experiment {experiment!r} in {results_dir}: choices are {', '.join(names)}")
        names = [experiment]
    history = load_runs(results_dir, history=True, repair=False)
    groups = [(name, [r for r in runs if (r["experiment"] or NO_EXPERIMENT) == name], history) for name in names]
    for name, mine, _ in groups:
        paper_of(name, mine)
    return names, groups


def check_out_paths(out_dir: str, json_path: Optional[str]) -> None:
    """--out must be a folder (or creatable as one) we can write, --json a file path in an existing folder: one-line
    UserError otherwise, before any work."""
    probe = out_dir
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"output folder (--out) {out_dir!r} is a file: give a folder for report.md and "
                        "report.html")
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"output folder (--out) {out_dir!r}: cannot create or write a folder there "
                        f"({probe!r} is not writable)")
    if json_path is not None:
        folder = os.path.dirname(os.path.abspath(json_path))
        if os.path.isdir(json_path) or not json_path or json_path.endswith(os.sep):
            raise UserError(f"--json {json_path!r} is a folder: give a file path (e.g. verdicts.json)")
        if not os.path.isdir(folder):
            raise UserError(f"--json {json_path!r}: no folder {folder!r}")
        if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(json_path)
                                                        and not os.access(json_path, os.W_OK)):
            raise UserError(f"--json {json_path!r}: not writable")


def verdicts_json(sections: list[Section]) -> dict:
    """Per experiment: its verdict, the count, and every claim with our figure, the paper's and the verdict."""
    out = {}
    for sec in sections:
        if sec.verdict is None:
            continue
        out[sec.title] = {"verdict": sec.verdict[0], "summary": sec.verdict[1],
                          "claims": [v.as_dict() for v in sec.verdicts]}
    return out


def verdict_lines(sections: list[Section]) -> list[str]:
    """The verdicts for the terminal: one line per experiment, one per claim."""
    lines = []
    for sec in sections:
        if sec.verdict is None:
            continue
        lines.append(f"{sec.title}: {sec.verdict[0]} ({sec.verdict[1]})")
        for v in sec.verdicts:
            interval = f" 95% {v.interval} ({v.items})" if v.interval else ""
            figure = f"ours {v.ours or '-'}{interval} | paper {v.paper}"
            lines.append(f"  [{v.verdict}] {v.claim} ({v.metric}; {v.expected}): {figure}"
                         + (f" -- {v.why}" if v.why else ""))
    return lines


def write_report(results_dir: str, out_dir: Optional[str] = None, experiment: Optional[str] = None,
                 json_path: Optional[str] = None) -> dict:
    """Write report.md (+ plots/), report.html, runs.csv and (json_path) the verdicts as JSON; returns their paths
    and the verdict lines."""
    results_dir = os.path.abspath(results_dir)
    out_dir = os.path.abspath(out_dir or os.path.join(results_dir, "report"))
    check_out_paths(out_dir, json_path)
    names, groups = build(results_dir, experiment)
    os.makedirs(out_dir, exist_ok=True)
    everything = load_runs(results_dir, repair=False, warn_corrupt=False)
    sections = []
    for name, runs, history in groups:
        mine = {r["run_dir"] for r in runs}
        sections.append(experiment_section(name, runs, history, out_dir,
                                           [r for r in everything if r["run_dir"] not in mine]))
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    intro = [f"Results folder: `{results_dir}`; {sum(len(g[1]) for g in groups)} runs; generated {now}.",
             "Verdicts judge the paper's claims (relations between its rows) on our rows, on 95% bootstrap "
             "intervals (paired over the items the rows share): reproduced (the whole interval on the claim's "
             "side), not reproduced (wholly on the other side), inconclusive (the data cannot tell), or not run (a "
             "row has no run). Each table row links its run folder (config.yaml, metrics.json, "
             "samples.jsonl); `diff` = ours - paper, on the paper's model and data only."]
    unconfigured = sorted(os.path.basename(r["run_dir"]) for r in everything if not r["config"])
    if unconfigured:
        intro.append(f"{len(unconfigured)} run folder(s) without a readable config.yaml, left out: "
                     + ", ".join(unconfigured[:10]) + (" ..." if len(unconfigured) > 10 else ""))
    judged = [f"{sec.title}: {sec.verdict[0]}" for sec in sections if sec.verdict]
    if judged:
        intro.append("Verdicts: " + "; ".join(judged) + ".")
    title = "kvbench report" + (f": {experiment}" if experiment else "")
    md_path, html_path = os.path.join(out_dir, "report.md"), os.path.join(out_dir, "report.html")
    atomic_write_text(md_path, to_markdown(title, intro, sections, out_dir))
    atomic_write_text(html_path, to_html(title, intro, sections))
    csv_path = os.path.join(out_dir, "runs.csv")  # every run of the report as one flat pandas table
    frame = runs_frame([r for _, runs, _ in groups for r in runs], config_columns=True)
    atomic_write_text(csv_path, frame.to_csv(index=False))
    if json_path is not None:
        atomic_write_text(json_path, json.dumps(verdicts_json(sections), indent=2) + "\n")
    return {"markdown": md_path, "html": html_path, "csv": csv_path, "json": json_path, "experiments": names,
            "verdicts": verdict_lines(sections)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvbench-report", description=__doc__.split("\n\n")[1])
    p.add_argument("results_dir", help="a results folder (results_dir of the runs)")
    p.add_argument("--experiment", help="only this experiment (the runs' `experiment` key)")
    p.add_argument("--out", help="output folder (default: RESULTS_DIR/report)")
    p.add_argument("--json", help="also write the verdicts (per experiment and claim) to this JSON file")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("kvbench-report needs matplotlib: pip install 'kvbench[report]'") from None
    paths = write_report(args.results_dir, args.out, args.experiment, args.json)
    for line in paths["verdicts"]:  # names from the records: control characters shown, never sent to the terminal
        print(visible(line))
    print(visible(f"kvbench-report: wrote {paths['markdown']} and {paths['html']}"
                  + (f" and {paths['json']}" if paths["json"] else "")
                  + f" ({len(paths['experiments'])} experiments: {', '.join(paths['experiments'])})"))
    corrupt = corrupt_runs(args.results_dir)
    if corrupt:  # unreadable metrics.json or config.yaml: left out of the report
        print(visible(f"kvbench-report: {len(corrupt)} corrupt run folder(s): " + "; ".join(
            f"{name} ({why}: left out)"
            for name, why in corrupt)))
    return 0


def cli() -> None:
    """Console entry point: exit 2 on bad input (one line on stderr)."""
    exit_with(main)


if __name__ == "__main__":
    cli()
