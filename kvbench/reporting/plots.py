"""The report's plots (matplotlib, Agg backend), each returned as PNG bytes or None when the runs have no data for it.

    metric_vs_budget(runs, "ppl")     one line per method (codecs and `full` as flat reference lines)

Every plot colours a run by its method (METHOD_COLORS: the same colour for a method in every plot; other settings
by line style and marker) and uses a log axis only for data spanning more than a decade (wants_log). Callers pass
comparable runs (same model, task and runtime settings: kvbench.reporting.report groups them).
    pareto(runs, "ppl")               metric against held KV bytes beside metric against peak KV bytes, the Pareto
                                      front as a line through its points only, points labelled with budget/ratio
    memory_and_reads(runs, "ppl")     peak KV bytes resident against K/V bytes read per decoded token (two KV axes)
    longbench_bars(runs, paper_rows)  per-dataset LongBench scores (ours as bars, the paper's as markers)
    needle_heatmaps(runs)             accuracy per (context length, depth) cell, one panel per run
    throughput(runs)                  output tokens/s against the KV pool size (task=throughput runs)
    kv_over_generation(runs)          one sequence's KV MiB against its generated tokens (kv_curve.csv of the
                                      reasoning tasks): decode-time compression flat, the full cache growing
    history(runs, metric)             a metric per commit, one line per setting (an asv-style regression dashboard)
    leaderboard(runs, "score")        kvpress's leaderboard figure: the metric against compression_ratio (a threshold
                                      run's realized ratio, 1 - kv_kept_fraction), one line per
                                      method, no-eviction runs (full) as reference lines from ratio 0, each point's
                                      peak KV MiB (measured from the pool) written beside it
"""
from __future__ import annotations

import csv
import io
import os
import re
from typing import Any, Optional, Sequence

from kvbench.reporting.stats import lower_is_better

MAX_SERIES = 12
MAX_BOARD_SERIES = 24  # the leaderboard figure draws every method of the board (kvpress's has 16)

# One colour per method in every plot (codecs by name and bits: KIVI-2 and KIVI-4 are told apart); settings other
# than the method (block size, sinks, ...) are told apart by line style and marker, never by colour.
METHOD_COLORS = {
    "full": "#222222", "streaming_llm": "#1f77b4", "h2o": "#ff7f0e", "paged_eviction": "#2ca02c",
    "snapkv": "#d62728", "key_diff": "#9467bd", "kvcrush": "#8c564b",
    "kivi": "#e377c2", "kivi2": "#e377c2", "kivi4": "#f7b6d2", "kvquant": "#17becf", "kvquant2": "#9edae5",
    "kvquant3": "#17becf", "kvquant4": "#0e7c8a", "int8": "#7f7f7f", "fp8": "#bcbd22",
    "random": "#9e9e9e", "knorm": "#006d2c", "tova": "#e6ab02", "expected_attention": "#0b3d91",
    "pyramidkv": "#f08080", "lagkv": "#66c2a5", "adakv": "#e7298a", "criticalkv": "#6a3d9a",
    "duo_attention": "#00ced1", "kvzip": "#a0522d",
}
_SPARE = ("#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354")
STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LOG_SPAN = 10.0  # a log axis only when the data spans more than this factor (one decade)


def method_key(run: dict) -> str:
    """The method a run's colour stands for: the method, or the codec and its bits for a codec run (method=full
    quant=kivi bits=2 -> kivi2)."""
    cfg = run["cfg"]
    quant = cfg.get("quant.name") or run["metrics"].get("quant") or "none"
    if quant not in ("none", "full"):
        bits = cfg.get("quant.bits")
        return f"{quant}{bits if isinstance(bits, int) and not isinstance(bits, bool) else ''}"
    return str(cfg.get("method.name") or run["metrics"].get("method"))


def method_color(name: str) -> str:
    """The fixed colour of a method (a stable pick from a spare palette for a method not in METHOD_COLORS)."""
    if name in METHOD_COLORS:
        return METHOD_COLORS[name]
    import zlib

    return _SPARE[zlib.crc32(name.encode()) % len(_SPARE)]


def wants_log(values: Sequence[float]) -> bool:
    """A log axis for positive data spanning more than a decade; linear for a narrow range (e.g. ppl 25.7-26.3)."""
    vals = [v for v in values if v is not None]
    return bool(vals) and min(vals) > 0 and max(vals) / min(vals) > LOG_SPAN


class _Styler:
    """Colour by method; line style and marker by the order a method's series appear in (one plot)."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def __call__(self, run: dict) -> dict:
        key = method_key(run)
        i = self.seen.get(key, 0)
        self.seen[key] = i + 1
        return {"color": method_color(key), "linestyle": STYLES[i % len(STYLES)], "marker": MARKERS[i % len(MARKERS)]}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any, dpi: int = 80) -> bytes:
    plt = _plt()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", pad_inches=0.1)  # no label or legend clipped
    plt.close(fig)
    return buf.getvalue()


def _log(axis: Any, set_scale: Any) -> None:
    """A log axis labelled with plain numbers (25, 100, 1000), not powers of ten."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    set_scale("log")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _legend(ax: Any) -> None:
    """The legend beside the axes (right), never over the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if value == value else None


def series_label(run: dict) -> str:
    """The line a run belongs to: run["series"] when the report set it (method plus the settings that vary in the
    experiment), else method[+codec bits] [model]."""
    if run.get("series"):
        return run["series"]
    cfg = run["cfg"]
    label = str(cfg.get("method.name") or run["metrics"].get("method"))
    quant = cfg.get("quant.name") or "none"
    if quant not in ("none", "full"):
        label += f"+{quant}" + (str(cfg["quant.bits"]) if cfg.get("quant.bits") is not None else "")
    model = run["metrics"].get("model")
    return label if model is None else f"{label} [{model}]"


def _by_series(runs: Sequence[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(series_label(run), []).append(run)
    return dict(list(out.items())[:MAX_SERIES])


def _x_of(run: dict, x_key: str) -> Optional[float]:
    return _num(run["metrics"].get("budget")) if x_key == "budget" else _num(run["cfg"].get(x_key))


def metric_vs_budget(runs: Sequence[dict], metric: str, x_key: str = "budget") -> Optional[bytes]:
    """The metric against the budget (or another numeric setting, x_key = a dotted config key), one line per
    series, coloured by method; methods that do not evict are flat reference lines. Pass comparable runs only
    (same model, task and runtime settings): a reference line is drawn across every point of the plot."""
    xs = {_x_of(r, x_key) for r in runs if _num(r["metrics"].get(metric)) is not None}
    xs.discard(None)
    if len(xs) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    style = _Styler()
    ys: list[float] = []
    for label, rs in _by_series(runs).items():
        pts = sorted((_x_of(r, x_key), _num(r["metrics"].get(metric))) for r in rs
                     if _x_of(r, x_key) is not None and _num(r["metrics"].get(metric)) is not None)
        flat = [v for v in (_num(r["metrics"].get(metric)) for r in rs) if v is not None]
        st = style(rs[0])
        if x_key == "budget" and _flat(rs) and flat:  # no eviction: the value does not depend on the budget
            ax.axhline(flat[-1], linestyle="--", linewidth=1, label=f"{label} (no eviction)", color=st["color"])
            ys.append(flat[-1])
        elif pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, **st)
            ys += [p[1] for p in pts]
    if x_key == "budget":
        if wants_log(sorted(xs)):
            ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (KV tokens per sequence, layer, kv-head)")
    else:
        ax.set_xlabel(x_key)
    ax.set_xticks(sorted(xs))
    ax.set_xticklabels([f"{x:g}" for x in sorted(xs)])
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better(metric) else ""))
    if wants_log(ys):
        _log(ax.yaxis, ax.set_yscale)
    ax.set_title(f"{metric} vs {x_key}")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)


def _flat(runs: Sequence[dict]) -> bool:
    """Runs of a method that does not evict (full or a codec): its budget does not change its result. The record
    says so (`evicts`); a record from before that field: flat when none of the runs has a budget."""
    evicts = runs[0]["metrics"].get("evicts")
    if isinstance(evicts, bool):
        return not evicts
    return all(r["metrics"].get("budget") is None for r in runs)


def pareto_front(points: Sequence[tuple[float, float]], lower_is_better_: bool) -> list[tuple[float, float]]:
    """The points (memory, metric) no other point beats on both axes (less or equal memory and a better or equal
    metric, one of them strictly), by memory ascending; of equal points, one."""
    front: list[tuple[float, float]] = []
    best: Optional[float] = None
    for x, y in sorted(points, key=lambda p: (p[0], p[1] if lower_is_better_ else -p[1])):
        if best is None or (y < best if lower_is_better_ else y > best):
            front.append((x, y))
            best = y
    return front


def knob_label(run: dict) -> str:
    """A point's label: what sets its compression (the ratio, "t=-3" for a threshold, the budget; "" for none)."""
    threshold = _num(run["cfg"].get("method.threshold"))
    if threshold is not None:
        return f"t={threshold:g}"
    ratio = ratio_of(run)
    if ratio is not None:
        return f"{ratio:g}"
    budget = _num(run["cfg"].get("budget", run["metrics"].get("budget")))
    return f"{budget:g}" if budget is not None else ""


# The two memory axes of the Pareto figure: what the method keeps once it compressed (held) and what the pool
# peaked at (a method that compresses after prefill peaks at the whole prompt: both are true, a reader needs both).
PARETO_AXES = (("held_kv_bytes", "KV held after compression (MiB)"),
               ("peak_kv_bytes", "peak KV memory (MiB, measured from the pool)"))


def pareto(runs: Sequence[dict], metric: str) -> Optional[bytes]:
    """The metric against held KV memory beside the metric against peak KV memory (one marker colour per method),
    the Pareto front through the best points of each, every point labelled with its budget, ratio or threshold.
    A panel whose runs recorded one size only (or none: held_kv_bytes is newer) is left out. Pass comparable
    runs only."""
    panels = []
    for key, xlabel in PARETO_AXES:
        pts = [(_num(r["metrics"].get(key)), _num(r["metrics"].get(metric)), series_label(r), r) for r in runs]
        pts = [p for p in pts if p[0] is not None and p[1] is not None and p[0] > 0]
        if len(pts) >= 2 and len({p[0] for p in pts}) >= 2:  # one KV size: nothing to trade off
            panels.append((key, xlabel, pts))
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels) + 1.5, 4.2), sharey=True, squeeze=False)
    low = lower_is_better(metric)
    for ax, (key, xlabel, pts) in zip(axes[0], panels):
        style = _Styler()
        for label in list(dict.fromkeys(p[2] for p in pts))[:MAX_BOARD_SERIES]:  # every point of the front shown
            mine = [p for p in pts if p[2] == label]
            st = style(mine[0][3])
            ax.scatter([p[0] / 2**20 for p in mine], [p[1] for p in mine], label=label, s=28, color=st["color"],
                       marker=st["marker"])
            for p in mine:
                text = knob_label(p[3])
                if text:
                    ax.annotate(text, (p[0] / 2**20, p[1]), fontsize=7, xytext=(4, 3), textcoords="offset points")
        front = pareto_front([(p[0], p[1]) for p in pts], low)
        # the front as a line through its own points only (a step line's corners are no runs, and its vertical
        # segments ran through dominated points); each point of the front ringed
        ax.plot([p[0] / 2**20 for p in front], [p[1] for p in front], color="black", linewidth=1, zorder=1,
                marker="o", markersize=9, markerfacecolor="none", markeredgewidth=0.8, label="Pareto front")
        ax.set_xlabel(xlabel)
        if wants_log([p[1] for p in pts]):
            _log(ax.yaxis, ax.set_yscale)
        if wants_log([p[0] for p in pts]):
            _log(ax.xaxis, ax.set_xscale)
        ax.set_title(f"{metric} vs {'held' if key == 'held_kv_bytes' else 'peak'} KV")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric + (" (lower is better)" if low else ""))
    _legend(axes[0][-1])
    return _png(fig)


def memory_and_reads(runs: Sequence[dict], metric: Optional[str] = None) -> Optional[bytes]:
    """The two KV axes of every run on one figure: resident memory (peak_kv_bytes, measured from the pool) against
    the K/V bytes its decode steps read per generated token (kv_read_bytes_per_token, from the blocks the kernels
    were given). Eviction and codecs move a run left (less resident, and so less read); retrieval (quest) moves it
    down only (everything stays resident, less is read). Each point is labelled with `metric` where given."""
    pts = [(_num(r["metrics"].get("peak_kv_bytes")), _num(r["metrics"].get("kv_read_bytes_per_token")),
            series_label(r), r) for r in runs]
    pts = [p for p in pts if p[0] is not None and p[1] is not None and p[0] > 0 and p[1] > 0]
    if len(pts) < 2 or len({(p[0], p[1]) for p in pts}) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    style = _Styler()
    for label in list(dict.fromkeys(p[2] for p in pts))[:MAX_BOARD_SERIES]:
        mine = [p for p in pts if p[2] == label]
        st = style(mine[0][3])
        ax.scatter([p[0] / 2**20 for p in mine], [p[1] / 2**20 for p in mine], label=label, s=28, color=st["color"],
                   marker=st["marker"])
        for p in mine:
            value = _num(p[3]["metrics"].get(metric)) if metric else None
            if value is not None:
                ax.annotate(f"{value:.3g}", (p[0] / 2**20, p[1] / 2**20), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xlabel("peak KV memory resident (MiB, measured from the pool)")
    ax.set_ylabel("K/V read per decoded token (MiB)")
    if wants_log([p[0] for p in pts]):
        _log(ax.xaxis, ax.set_xscale)
    if wants_log([p[1] for p in pts]):
        _log(ax.yaxis, ax.set_yscale)
    ax.set_title("KV resident vs KV read" + (f" (labels: {metric})" if metric else ""))
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)


DATASET_KEY = re.compile(r"^score_(?!.*_(0-4k|4-8k|8k\+)$)(.+)$")


def longbench_bars(runs: Sequence[dict], paper_rows: Sequence[Optional[dict]] = (),
                   title: str = "LongBench per dataset") -> Optional[bytes]:
    """Grouped bars: one group per dataset, one bar per run; the paper's per-dataset value of the run's row as a
    black tick."""
    runs = [r for r in runs if any(DATASET_KEY.match(k) and _num(v) is not None for k, v in r["metrics"].items())]
    if not runs:
        return None
    runs = runs[:8]
    rows = list(paper_rows)[:len(runs)] + [None] * (len(runs) - len(paper_rows))
    datasets = sorted({DATASET_KEY.match(k).group(2) for r in runs for k in r["metrics"]
                       if DATASET_KEY.match(k) and _num(r["metrics"][k]) is not None})
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(datasets) + 4), 4.2))
    width = 0.8 / len(runs)
    style = _Styler()
    for i, (run, row) in enumerate(zip(runs, rows)):
        xs = [j + i * width for j in range(len(datasets))]
        st = style(run)
        ax.bar(xs, [_num(run["metrics"].get(f"score_{d}")) or 0 for d in datasets], width, label=series_label(run),
               color=st["color"], hatch=_HATCH[STYLES.index(st["linestyle"])], edgecolor="white")
        per = (row or {}).get("per_dataset") or {}
        tick = [(x, per.get(d)) for x, d in zip(xs, datasets) if per.get(d) is not None]
        if tick:
            ax.scatter([t[0] for t in tick], [t[1] for t in tick], marker="_", color="black", s=120,
                       label="paper" if i == 0 else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(datasets))])
    ax.set_xticklabels(datasets, rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("score (x100)")
    ax.set_title(title)
    _legend(ax)
    return _png(fig)


_HATCH = ("", "//", "..", "xx")

CELL = re.compile(r"^acc_(\d+)_(\d+(?:\.\d+)?)$")


def needle_heatmaps(runs: Sequence[dict], limit: int = 24) -> Optional[bytes]:
    """Accuracy per (context length, depth) cell, one panel per run; None when every run has a single cell."""
    panels = []
    for run in runs:
        cells = {}
        for key, value in run["metrics"].items():
            m = CELL.match(key)
            if m and _num(value) is not None:
                cells[(int(m.group(1)), float(m.group(2)))] = float(value)
        if cells:
            panels.append((run, cells))
    if not panels or all(len(cells) == 1 for _, cells in panels):
        return None  # no panels, or one cell each: the accuracy plot already shows it
    panels = panels[:limit]
    plt = _plt()
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.2 * cols, 2.6 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (run, cells) in zip(axes.flat, panels):
        lengths = sorted({k[0] for k in cells})
        depths = sorted({k[1] for k in cells})
        grid = [[cells.get((n, d), float("nan")) for n in lengths] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)))
        ax.set_xticklabels(lengths, fontsize=7)
        ax.set_yticks(range(len(depths)))
        ax.set_yticklabels([f"{d:g}%" for d in depths], fontsize=7)
        ax.set_title(f"{series_label(run)} b{run['metrics'].get('budget')}", fontsize=8)
    fig.suptitle("needle accuracy (x: context tokens, y: depth)", fontsize=9)
    return _png(fig)


def throughput(runs: Sequence[dict]) -> Optional[bytes]:
    pts = [(r, _num(r["metrics"].get("kv_pool_bytes")), _num(r["metrics"].get("output_tokens_per_s")))
           for r in runs]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    style = _Styler()
    for label in list(dict.fromkeys(series_label(p[0]) for p in pts))[:MAX_SERIES]:
        mine = sorted((p for p in pts if series_label(p[0]) == label), key=lambda p: p[1])
        ax.plot([p[1] / 2**20 for p in mine], [p[2] for p in mine], label=label, **style(mine[0][0]))
        for run, x, y in mine:
            seqs = run["metrics"].get("max_running_seqs")
            if seqs is not None:
                ax.annotate(f"{seqs} seqs", (x / 2**20, y), fontsize=6, textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("KV pool (MiB)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs KV memory")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)


def _timeline_usage(run: dict) -> Optional[tuple[list[float], list[float]]]:
    """(time s, pool in use %) per step from a throughput run's timeline.csv, or None when it is not there."""
    folder = run["metrics"].get("run_dir")
    path = os.path.join(folder, "timeline.csv") if folder else None
    if not path or not os.path.isfile(path):
        return None
    t, usage = [], []
    try:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                t.append(float(row["t_s"]))
                pct = row.get("pool_usage_pct")
                usage.append(float(pct) if pct not in (None, "") else
                             100.0 * float(row["blocks_in_use"]) / max(float(row["pool_blocks"]), 1.0))
    except (OSError, KeyError, ValueError):
        return None
    return (t, usage) if t else None


def pool_usage(runs: Sequence[dict]) -> Optional[bytes]:
    """KV pool in use (%) over time, one line per throughput run (from each run folder's timeline.csv)."""
    lines = [(r, _timeline_usage(r)) for r in runs if r["metrics"].get("task") == "throughput"]
    lines = [(r, tu) for r, tu in lines if tu is not None][:MAX_SERIES]
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    style = _Styler()
    for run, (t, usage) in lines:
        st = style(run)
        ax.step(t, usage, where="post", label=series_label(run), color=st["color"], linestyle=st["linestyle"], lw=1)
    return _percent_plot(fig, ax, "time (s)", "KV pool in use (%)", "KV pool usage over time")


def acceptance_vs_draft_budget(runs: Sequence[dict]) -> Optional[bytes]:
    """Speculative decoding's acceptance rate against the draft cache's budget, one line per draft method (and k):
    how often a method's compressed cache predicts the full model's next token."""
    pts = [(r, _num(r["metrics"].get("runtime_speculative_budget")), _num(r["metrics"].get("acceptance_rate")))
           for r in runs]
    pts = [p for p in pts if p[1] is not None and p[2] is not None]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    by: dict[str, list] = {}
    for p in pts:
        m = p[0]["metrics"]
        by.setdefault(f"{m.get('runtime_speculative_method')} draft, k={m.get('runtime_speculative_num_tokens')}",
                      []).append(p)
    for label, mine in list(by.items())[:MAX_SERIES]:
        mine.sort(key=lambda p: p[1])
        key = str(mine[0][0]["metrics"].get("runtime_speculative_method"))
        ax.plot([p[1] for p in mine], [100.0 * p[2] for p in mine], label=label, color=method_color(key),
                marker="o")
    if wants_log([p[1] for p in pts]):
        _log(ax.xaxis, ax.set_xscale)
    return _percent_plot(fig, ax, "draft budget (KV tokens per sequence, layer and kv-head)", "acceptance rate (%)",
                         "speculative decoding: acceptance vs draft budget")


def turn_scores(run: dict) -> list[tuple[int, float]]:
    """A multi-turn run's (turn, score) points from its score_turn_<k> metrics (task=scbench), by turn."""
    pts = []
    for key, value in run["metrics"].items():
        if key.startswith("score_turn_") and key[len("score_turn_"):].isdigit() and _num(value) is not None:
            pts.append((int(key[len("score_turn_"):]), float(value)))
    return sorted(pts)


def score_vs_turn(runs: Sequence[dict]) -> Optional[bytes]:
    """The score of each turn (score_turn_<k>) against the turn, one line per series (method and the settings that
    vary), coloured by method: what a compression kept for the first question and lost for the later ones."""
    lines = [(r, turn_scores(r)) for r in runs]
    lines = [(r, pts) for r, pts in lines if len(pts) >= 2]
    if not lines:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    style = _Styler()
    for run, pts in lines[:MAX_SERIES]:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=series_label(run), **style(run))
    turns = sorted({p[0] for _, pts in lines for p in pts})
    ax.set_xticks(turns)
    return _percent_plot(fig, ax, "turn (question k over the same context)", "score", "score by turn")


def _percent_plot(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str) -> bytes:
    """Labels, a 0-105 % y axis, grid and legend; the PNG."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 105)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)


def history(points: dict[str, list[tuple[str, float]]], commits: Sequence[str], metric: str,
            methods: Optional[dict[str, str]] = None) -> Optional[bytes]:
    """points: setting label -> [(commit, value)]; commits in order; methods: label -> method_key (its colour).
    None with fewer than two commits."""
    if len(commits) < 2 or not points:
        return None
    index = {c: i for i, c in enumerate(commits)}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    seen: dict[str, int] = {}
    for label, pts in list(points.items())[:MAX_SERIES]:
        pts = sorted(pts, key=lambda p: index[p[0]])
        key = (methods or {}).get(label, label)
        i = seen[key] = seen.get(key, -1) + 1
        ax.plot([index[c] for c, _ in pts], [v for _, v in pts], label=label, color=method_color(key),
                linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)])
    ax.set_xticks(range(len(commits)))
    ax.set_xticklabels([c[:8] for c in commits], rotation=30, fontsize=7)
    ax.set_xlabel("git commit (in the order first run)")
    ax.set_ylabel(metric)
    if wants_log([v for pts in points.values() for _, v in pts]):
        _log(ax.yaxis, ax.set_yscale)
    ax.set_title(f"{metric} across commits")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)


def ratio_of(run: dict) -> Optional[float]:
    """The run's compression_ratio (config, else metrics.json), None when it has none."""
    value = run["cfg"].get("compression_ratio", run["metrics"].get("compression_ratio"))
    return _num(value)


def realized_ratio(run: dict) -> Optional[float]:
    """A threshold run's (method.threshold: methods/dms.py) realized compression ratio, 1 - kv_kept_fraction (how
    much its inputs let it remove), None for any other run."""
    if _num(run["cfg"].get("method.threshold")) is None:
        return None
    kept = _num(run["metrics"].get("kv_kept_fraction"))
    return None if kept is None else round(1.0 - kept, 4)


def board_ratio(run: dict) -> Optional[float]:
    """The leaderboard's x of a run: its compression_ratio, else its realized one (a threshold run), else None."""
    ratio = ratio_of(run)
    return ratio if ratio is not None else realized_ratio(run)


def _mib(run: dict) -> Optional[float]:
    value = _num(run["metrics"].get("peak_kv_bytes"))
    return None if value is None else value / 2**20


def spread_labels(wanted: Sequence[float], step: float) -> list[float]:
    """Label positions as near as possible to `wanted` (ascending) and at least `step` apart: least squares under
    the spacing constraints (pool-adjacent-violators on wanted[i] - i * step)."""
    blocks: list[list[float]] = []  # [mean, count]
    for i, w in enumerate(wanted):
        blocks.append([w - i * step, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    out: list[float] = []
    for mean, count in blocks:
        out += [mean + (len(out) + j) * step for j in range(int(count))]
    return out


def leaderboard(runs: Sequence[dict], metric: str) -> Optional[bytes]:
    """The metric against the compression ratio (kvpress's leaderboard figure): one line per series (method) over
    the runs with a ratio; runs of methods that do not evict (full, codecs) as dashed reference lines from ratio 0.
    Beside each point its peak KV MiB, in the series' colour: the labels of one ratio stand in a column to the
    right of its points, as near their points as the spacing allows (leader lines back to them); the points of one
    ratio are spread a little sideways (and every line has its own marker) so that equal scores stay visible. Pass
    comparable runs only. None without a ratio run."""
    lines: dict[str, list[tuple[float, float, Optional[float]]]] = {}
    refs: list[tuple[str, float, Optional[float], dict]] = []
    firsts: dict[str, dict] = {}
    by_series: dict[str, list[dict]] = {}
    for run in runs:
        by_series.setdefault(series_label(run), []).append(run)
    for label, rs in list(by_series.items())[:MAX_BOARD_SERIES]:
        for r in rs:
            y, x = _num(r["metrics"].get(metric)), board_ratio(r)  # threshold runs at their realized ratio
            if y is None:
                continue
            if x is not None:
                lines.setdefault(label, []).append((x, y, _mib(r)))
                firsts.setdefault(label, r)
            elif _flat([r]):
                refs.append((label, y, _mib(r), r))
    if not lines:
        return None
    xs = sorted({p[0] for pts in lines.values() for p in pts})
    set_xs = sorted({x for x in (ratio_of(r) for r in runs) if x is not None}) or xs  # the swept ratios
    gap = min([b - a for a, b in zip([0.0] + set_xs, set_xs) if b > a] or [0.25])
    n = len(lines)
    spread = 0.12 * gap  # the sideways spread of one ratio's points
    dodge = {label: (i - (n - 1) / 2) * spread / max(1, n - 1) for i, label in enumerate(lines)}
    plt = _plt()
    height = max(4.8, 2.2 + 0.2 * (n + len(refs)))
    fig, ax = plt.subplots(figsize=(max(11.0, 5.0 + 1.2 * len(xs)), height))
    ys = [p[1] for pts in lines.values() for p in pts] + [r[1] for r in refs]
    lo, hi = min(ys + [0.0]), max(ys + [1.0])
    pad = 0.06 * (hi - lo or 1.0)
    label_pts: dict[float, list] = {}  # column x -> [(y, text, colour, point)]
    for i, (label, pts) in enumerate(lines.items()):
        pts = sorted(pts)
        color = method_color(method_key(firsts[label]))
        px = [x + dodge[label] for x, _, _ in pts]
        ax.plot(px, [y for _, y, _ in pts], label=label, color=color, marker=MARKERS[i % len(MARKERS)],
                linestyle=STYLES[(i // len(MARKERS)) % len(STYLES)], markersize=5, linewidth=1.3)
        for (x, y, mib), x_shown in zip(pts, px):
            if mib is not None:
                label_pts.setdefault(x, []).append((y, f"{mib:.1f}", color, (x_shown, y)))
    for label, y, mib, r in refs:
        color = method_color(method_key(r))
        ax.axhline(y, linestyle="--", linewidth=1, color=color,
                   label=f"{label} (no eviction)" + (f", {mib:.1f} MiB" if mib is not None else ""))
        ax.plot([0.0], [y], marker="o", color=color, markersize=6)
        if mib is not None:
            label_pts.setdefault(0.0, []).append((y, f"{mib:.1f}", color, (0.0, y)))
    ticks = [0.0] + set_xs if set_xs[0] > 0 else set_xs
    ax.set_xlim(-0.5 * spread - 0.05 * gap, xs[-1] + spread / 2 + 0.4 * gap)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{x:g}" for x in ticks])
    ax.set_xlabel("compression ratio (share of each context's KV removed at prefill; 0 = full cache; threshold "
                  "runs at their realized ratio, 1 - kv_kept_fraction)")
    ax.set_ylabel(metric + (" (lower is better)" if lower_is_better(metric) else ""))
    ax.set_title(f"{metric} vs compression ratio; beside each point its peak KV MiB (measured from the pool)")
    ax.grid(alpha=0.3)
    _legend(ax)
    # one column of labels per ratio, LABEL_GAP points apart on the finished axes (6.5 pt text)
    for x, items in label_pts.items():
        items.sort(key=lambda t: (t[0], t[3][0]))
    placed = place_label_columns(fig, ax, {x: [t[0] for t in items] for x, items in label_pts.items()},
                                 (lo - pad, hi + pad))
    for x, items in label_pts.items():
        tx = x + spread / 2 + 0.06 * gap
        for (y, text, color, point), ty in zip(items, placed[x]):
            ax.annotate(text, xy=point, xytext=(tx, ty), textcoords="data", fontsize=6.5, color=color,
                        va="center", arrowprops={"arrowstyle": "-", "color": color, "linewidth": 0.4, "alpha": 0.5},
                        bbox={"boxstyle": "square,pad=0.05", "facecolor": "white", "edgecolor": "none",
                              "alpha": 0.75})
    return _png(fig, dpi=100)  # small labels: a finer raster


LABEL_GAP = 9.0  # points between the centres of two labels of one column (6.5 pt text and its box)


def _points_to_data(fig: Any, ax: Any, points: float) -> float:
    """How many y data units `points` take on the axes as laid out now (a linear y axis)."""
    fig.tight_layout()
    bottom, top = ax.get_ylim()
    height_in = ax.get_position().height * fig.get_figheight()
    return points / 72.0 * (top - bottom) / height_in


def place_label_columns(fig: Any, ax: Any, wanted: dict, limits: tuple[float, float]) -> dict:
    """Label heights per column (x -> wanted heights, ascending), each as near its point as LABEL_GAP points of
    spacing on the finished axes allow; the y limits grow to hold every label. The spacing in data units depends on
    the limits, which depend on the labels: the limits only grow until the labels, spaced for them, fit inside
    (placed once from an estimate, a stack that widened the axis afterwards came out closer than its text)."""
    bottom, top = limits
    placed: dict = {}
    for _ in range(12):
        ax.set_ylim(bottom, top)
        step = _points_to_data(fig, ax, LABEL_GAP)
        placed = {x: spread_labels(ys, step) for x, ys in wanted.items() if ys}
        need_bottom = min([bottom] + [p[0] - step for p in placed.values()])
        need_top = max([top] + [p[-1] + step for p in placed.values()])
        if need_bottom >= bottom and need_top <= top:
            break
        bottom, top = need_bottom, need_top
    ax.set_ylim(bottom, top)  # (when the labels never fit: the last limits, which hold them)
    return placed
KV_CURVE_FILE = "kv_curve.csv"  # written by the reasoning tasks (tasks/reasoning.py)


def kv_curve(run: dict) -> list[tuple[int, float]]:
    """(generated tokens, KV MiB) of a run's first generation, from its kv_curve.csv; [] when it has none."""
    import csv

    path = os.path.join(str(run.get("run_dir") or ""), KV_CURVE_FILE)
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    first = (rows[0]["id"], rows[0]["sample"])
    return [(int(r["new_tokens"]), int(r["kv_bytes"]) / 2**20) for r in rows if (r["id"], r["sample"]) == first]


def kv_over_generation(runs: Sequence[dict]) -> Optional[bytes]:
    """KV memory of one sequence against the tokens it has generated, one line per run (its first generation):
    decode-time compression flattens where the full cache grows."""
    curves = [(r, kv_curve(r)) for r in runs]
    curves = [(r, c) for r, c in curves if len(c) > 1]
    if not curves:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    style = _Styler()
    for run, pts in curves[:MAX_SERIES]:
        budget = run["metrics"].get("budget")
        label = series_label(run) + (f" b{budget}" if budget is not None else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, markevery=max(1, len(pts) // 8), **style(run))
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV of the sequence (MiB, blocks held)")
    ax.set_title("KV over the generation")
    ax.grid(alpha=0.3)
    _legend(ax)
    return _png(fig)
