"""`kvbench-compare BASE NEW` (also `python -m kvbench.reporting.compare`): a regression gate between two sets of runs.

    kvbench-compare results_main results_pr                            # two results folders
    kvbench-compare results --base-commit 1a2b3c --new-commit 4d5e6f   # two commits logged in one folder
    kvbench-compare BASE NEW --json verdict.json --gate-speed --max-slowdown 0.3
    kvbench-compare --pair RUN_A RUN_B [--metric score] [--min-effect 0.01] [--json pair.json]

--pair sets two run folders against each other (any method, budget, ratio or model over the same task and data):
"snapkv@0.5 vs expected_attention@0.5, score: -3.2 [-7.4, +1.1], inconclusive", the change A - B with its paired
bootstrap 95% interval over the shared samples or perplexity windows (kvbench.reporting.pair). Exit 0 when the data
resolve it (no difference, better, worse), 3 inconclusive, 1 a run failed or its score is missing/NaN, 2 runs over
different data (one line).

Runs are paired by the hash of their result-determining config without the code version
(kvbench.reporting.runs.pair_key); runs left over are paired on the config keys both sides know (a newer version
that adds a setting with its default still pairs; the keys ignored are listed, escaped; a pair made so where one side
records a data or method-file identity the other lacks is inconclusive). For each pair, every metric BASE
has a number for is compared:
- a score (ppl, nll, accuracy, score, score_<dataset>, rouge_*, lm-eval accuracies) is judged by the 95% interval
  of its change NEW - BASE (kvbench.reporting.judge): a bootstrap over the runs' samples.jsonl (per-sample scores;
  perplexity: the documents' windows of 64 tokens), paired when both runs scored the same items, else BASE's own
  interval around the change; never narrower than --rel-tol x |base| (default 1e-4: float noise). Against
  --min-effect (default 0.01: a relative change of 1% is worth flagging; --max-drop, in the metric's unit, when
  larger), the verdict is:
    regression    the interval excludes no change and the change reaches --min-effect;
    ok / better   the interval rules out a change the size of --min-effect (better: the whole of it improves);
    inconclusive  the interval holds both no change and --min-effect (a short run cannot tell): never PASS.
  ppl and nll are judged on one scale (log perplexity) and always get one verdict. A score that is missing, null,
  NaN or inf in NEW where BASE had a number is a regression; one null, NaN or inf in BASE where NEW has a number
  is inconclusive (never left out).
- a speed (prefill/decode/output/total tokens per second, requests per second; ttft_s, tpot_s, e2e_s and their
  percentiles) is shown with its change in % and NOT gated by default: a loss of more than --max-slowdown of the
  speed prints a warning line. With --gate-speed it is a regression. The loss is one scale for rates and latencies
  (0.5 = half the tokens per second, or twice the latency). The default --max-slowdown is 0.5 because single-shot
  timings on a shared machine move that far on their own (one competing busy process can take a core from a run
  that uses two: a 2x swing); only a slowdown beyond that is a signal there. On a dedicated machine use
  --gate-speed --max-slowdown 0.1.
- peak_kv_bytes regresses when it grows (a warning only for throughput traces with timed arrivals, whose batches
  depend on the clock); failed_requests regresses when it grows.
- a run that failed in NEW regresses (also one present in NEW only), and so does every run folder of NEW or BASE
  whose metrics.json or config.yaml cannot be read (truncated, not UTF-8, not a mapping), named with its folder: a
  BASE run that cannot be read leaves its setting ungated, so it fails the gate as a NEW one does.
- a BASE run (that finished well) with no finished NEW run of its setting regresses, "missing in NEW" (a folder
  deleted, a metrics.json never written, a config changed so that it no longer pairs): a crashed sweep never
  passes. --allow-missing says NEW is a deliberate subset: such runs are then counted and listed only.
- a NEW run whose samples.jsonl is missing, empty or shorter than BASE's, where BASE has per-sample records,
  regresses ("samples missing in NEW"), and its scores get no bootstrap tolerance (never a wider one).
- when one side holds several attempts of one setting (two folders with the same config), the newest attempt
  (finished_at) decides: a failed newest attempt is a regression even beside an older good one.
Runs present on one side only are listed; the summary line counts the runs missing in NEW. Nothing paired, or an empty or missing NEW, is bad input: one line,
exit 2, never PASS. Prints the verdict as Markdown (every metric compared, per run: base, new, change, its 95%
interval, the min effect, the interval's source, verdict; text from the records escaped), writes the same as JSON
with --json (a file path: a folder is bad input, before anything is printed). Exit codes: 0 pass, 1 a regression (whatever else), 2 bad input, 3 inconclusive (no regression, but a
score the data cannot resolve: run longer, or set --min-effect to the change that matters).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from kvbench.console import exit_with
from kvbench.errors import UserError
from kvbench.reporting import stats
from kvbench.reporting.escape import markdown_text as _escape
from kvbench.reporting.judge import judge_score, one_verdict
from kvbench.reporting.pair import NotPaired, pair_verdict, verdict_line
from kvbench.reporting.runs import describe, pair_key, result_keys, setting_of, varying_keys
from kvbench.store.files import write_json
from kvbench.store.files import read_json
from kvbench.store.runs import corrupt_runs, load_runs, make_run, samples_of

DEFAULT_REL_TOL = 1e-4
DEFAULT_MAX_SLOWDOWN = 0.5
DEFAULT_MIN_EFFECT = 0.01  # a 1% change of a score is worth flagging (perplexity: 1% relative)
EXIT_PASS, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE = 0, 1, 2, 3


@dataclass
class Limits:
    """How far NEW may move from BASE before it is a regression (see the module docstring)."""
    rel_tol: float = DEFAULT_REL_TOL
    max_drop: float = 0.0
    max_slowdown: float = DEFAULT_MAX_SLOWDOWN
    gate_speed: bool = False
    min_effect: float = DEFAULT_MIN_EFFECT  # the smallest relative change of a score worth flagging


def select_runs(folder: str, commit: Optional[str] = None, skip: frozenset = frozenset()) -> dict[str, dict]:
    """Runs of a folder keyed by pair key: the latest attempt of each run folder, or, for a commit (prefix), the
    last attempt of each run logged in runs.jsonl at that commit. Run folders named in `skip` are left out."""
    if not os.path.isdir(folder):
        raise UserError(f"no results folder {folder!r}")
    if commit is None:
        runs = load_runs(folder, repair=False, warn_corrupt=False)
    else:
        runs = [r for r in load_runs(folder, history=True, repair=False)
                if str(r["metrics"].get("git_commit") or "").startswith(commit)]
        if not runs:
            logged = load_runs(folder, history=True, repair=False)
            commits = sorted({str(r["metrics"].get("git_commit"))[:10] for r in logged})
            raise UserError(f"no runs of commit {commit!r} in {folder}: commits there are {', '.join(commits) or '(none)'}")
    out: dict[str, dict] = {}
    for run in sorted(runs, key=attempt_time):  # the newest attempt of one setting decides
        if os.path.basename(run["run_dir"]) in skip:
            continue
        key = pair_key(run)
        if key in out:
            older = out[key]
            run = dict(run, older_attempts=older.get("older_attempts", []) + [older])
        out[key] = run
    return out


def attempt_time(run: dict) -> str:
    """When an attempt ended (finished_at, else started_at; ISO text in UTC sorts in time order)."""
    m = run["metrics"]
    return str(m.get("finished_at") or m.get("started_at") or "")


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _why_not_a_number(metrics: dict, key: str) -> str:
    """Why NEW has no number for key: missing, null, NaN, inf (from `nonfinite_metrics`), or another value."""
    nonfinite = metrics.get("nonfinite_metrics") or {}
    value = metrics.get(key)
    if isinstance(nonfinite, dict) and key in nonfinite:
        return {"nan": "NaN"}.get(str(nonfinite[key]), str(nonfinite[key]))
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else str(value)
    if key not in metrics:
        return "missing"
    if value is None:
        return "null"
    return f"not a number ({value!r})"


def _timed_arrivals(run: dict) -> bool:
    """A throughput trace with Poisson arrivals on the wall clock: its batches (and peak memory) depend on timing."""
    rate = run["cfg"].get("task.request_rate")
    return run["cfg"].get("task.name") == "throughput" and isinstance(rate, (int, float)) and math.isfinite(rate)


def metric_kind(name: str) -> Optional[str]:
    """score | speed | memory | failures, or None for a metric kvbench-compare does not judge."""
    if stats.is_score(name):
        return "score"
    if stats.is_speed(name):
        return "speed"
    if name in stats.MEMORY:
        return "memory"
    if name in stats.FAILURE_COUNTS:
        return "failures"
    return None


def _row(name: str, base_run: dict, new_run: Optional[dict], metric: str, kind: str, **fields: Any) -> dict:
    """One compared metric: base, new, change (and in %), tolerance, its source, verdict, note, the run folders."""
    row = {"run": name, "metric": metric, "kind": kind, "base": None, "new": None, "change": None,
           "change_pct": None, "tolerance": None, "interval": None, "min_effect": None, "source": "",
           "verdict": "ok", "note": "",
           "base_run": base_run["run_dir"] if base_run else None, "new_run": new_run["run_dir"] if new_run else None}
    row.update(fields)
    return row


def _judge_metric(name: str, base: dict, new: dict, key: str, b: float, limits: Limits) -> Optional[dict]:
    kind = metric_kind(key)
    if kind is None:
        return None
    nm = new["metrics"]
    n = _number(nm.get(key))
    gated = kind != "speed" or limits.gate_speed
    if kind == "memory" and _timed_arrivals(base):
        gated = False
    if n is None:
        why = _why_not_a_number(nm, key)
        return _row(name, base, new, key, kind, base=b, new=why, source="BASE had a number",
                    verdict="regression" if gated else "warning", note=f"{key} is {why} in NEW")
    pct = (n - b) / abs(b) * 100.0 if b != 0 else None
    tasks_b, tasks_n = stats.score_tasks(base["metrics"]), stats.score_tasks(nm)
    if kind == "score" and stats.averages_tasks(key) and tasks_b and tasks_n and tasks_b != tasks_n:
        lost = sorted(set(tasks_b) - set(tasks_n))
        note = (f"{key} averages {len(tasks_n)} tasks in NEW, {len(tasks_b)} in BASE: not compared"
                + (f" ({', '.join(lost)} missing in NEW)" if lost else ""))
        return _row(name, base, new, key, kind, base=b, new=n, source="the tasks averaged differ",
                    verdict="regression" if lost else "warning", note=note)
    if kind == "score":
        base_samples, new_samples = samples_of(base), samples_of(new)
        j = judge_score(key, base_samples, new_samples, b, n, min_effect=limits.min_effect, rel_tol=limits.rel_tol,
                        max_drop=limits.max_drop, samples_lost=samples_lost(base_samples, new_samples))
        return _row(name, base, new, key, kind, base=b, new=n, change=n - b, change_pct=pct, tolerance=j.tolerance,
                    source=j.source, verdict=j.verdict, interval=[j.change_lo, j.change_hi],
                    min_effect=j.min_effect)
    if kind == "speed":
        loss = stats.speed_loss(key, b, n)
        if loss is None:
            return None
        over = loss > limits.max_slowdown
        verdict = ("regression" if gated else "warning") if over else \
            ("better" if loss < -limits.max_slowdown else "ok")
        source = "--max-slowdown" + ("" if gated else " (not gated: a warning)")
        return _row(name, base, new, key, kind, base=b, new=n, change=n - b, change_pct=pct,
                    tolerance=limits.max_slowdown, source=source, verdict=verdict,
                    note=f"{loss:.0%} slower" if loss > 0 else "")
    # memory, failures: must not grow
    verdict = ("regression" if gated else "warning") if n > b else ("better" if n < b else "ok")
    source = "must not grow" + ("" if gated else " (timed arrivals: a warning)")
    return _row(name, base, new, key, kind, base=b, new=n, change=n - b, change_pct=pct, tolerance=0.0,
                source=source, verdict=verdict)


def samples_lost(base_samples: Optional[list], new_samples: Optional[list]) -> bool:
    """BASE has per-sample records and NEW's are missing, empty or fewer."""
    return bool(base_samples) and len(new_samples or []) < len(base_samples or [])


def missing_samples(name: str, base: dict, new: dict) -> Optional[dict]:
    """A regression row when BASE has per-sample records and NEW's are missing, empty or fewer (a run cut short, or
    its samples.jsonl lost): the scores' intervals could not be checked, so the gate fails instead of widening them."""
    base_samples, new_samples = samples_of(base), samples_of(new)
    if not samples_lost(base_samples, new_samples):
        return None
    path = os.path.join(new["run_dir"], "samples.jsonl")
    what = ("samples.jsonl is missing" if new_samples is None and not os.path.isfile(path) else
            "samples.jsonl belongs to another attempt" if new_samples is None else
            "samples.jsonl is empty" if not new_samples else f"{len(new_samples)} of {len(base_samples)} samples")
    return _row(name, base, new, "samples", "samples", base=len(base_samples),
                new=len(new_samples or []), source="BASE has per-sample records", verdict="regression",
                note=f"samples missing in NEW: {what} (BASE has {len(base_samples)})")


def unjudged_scores(name: str, base: dict, new: dict) -> list[dict]:
    """An inconclusive row per score that BASE records without a number (null, NaN, inf) and NEW has a number for:
    nothing to judge NEW's value against, so the gate can never pass on it (a NEW ppl of 1e6 is not left out)."""
    bm, nm = base["metrics"], new["metrics"]
    nonfinite = bm.get("nonfinite_metrics") if isinstance(bm.get("nonfinite_metrics"), dict) else {}
    rows = []
    for key in sorted(set(bm) | set(nonfinite)):
        if metric_kind(key) != "score" or _number(bm.get(key)) is not None or _number(nm.get(key)) is None:
            continue
        why = _why_not_a_number(bm, key)
        rows.append(_row(name, base, new, key, "score", base=why, new=_number(nm.get(key)),
                         source="BASE has no number", verdict="inconclusive",
                         note=f"{key} is {why} in BASE and {_fmt(_number(nm.get(key)))} in NEW: not judged "
                              "(rerun BASE)"))
    return rows


def compare_pair(base: dict, new: dict, limits: Optional[Limits] = None, name: Optional[str] = None) -> list[dict]:
    """One row per compared metric of a paired run (see _row): verdict ok | better | warning | regression."""
    limits = limits or Limits()
    bm, nm = base["metrics"], new["metrics"]
    name = name or describe(new)
    if nm.get("status") != "ok":
        older = new.get("older_attempts") or []
        also = (f" (the newest of {len(older) + 1} attempts of this setting; older: "
                + ", ".join(f"{os.path.basename(o['run_dir'])} {o['metrics'].get('status')}" for o in older) + ")"
                if older else "")
        return [_row(name, base, new, "status", "status", base=bm.get("status"), new=nm.get("status"),
                     source="a failed run in NEW", verdict="regression",
                     note=f"failed in NEW: {nm.get('error') or 'no error recorded'}{also}")]
    if bm.get("status") != "ok":
        return [_row(name, base, new, "status", "status", base=bm.get("status"), new="ok",
                     source="failed in BASE: its metrics are not compared", verdict="better")]
    rows = [row for row in [missing_samples(name, base, new)] if row is not None]
    for key, bval in bm.items():
        b = _number(bval)
        if b is not None:
            row = _judge_metric(name, base, new, key, b, limits)
            if row is not None:
                rows.append(row)
    rows += unjudged_scores(name, base, new)
    one_verdict(rows)  # ppl and nll of one run: one verdict
    return rows


def compare(base_runs: dict[str, dict], new_runs: dict[str, dict], limits: Optional[Limits] = None, *,
            corrupt_new: list[tuple[str, str]] = (), corrupt_base: list[tuple[str, str]] = (),
            allow_missing: bool = False) -> dict:
    """The verdict as a JSON-ready dict: rows (every metric compared), regressions, warnings, the runs only in
    BASE / only in NEW, the corrupt run folders of each side, pairs, missing (BASE runs that finished well and have
    no finished NEW counterpart: regressions unless allow_missing), ok."""
    limits = limits or Limits()
    base_runs, new_runs, ignored = pair_on_shared_keys(base_runs, new_runs)
    keys = [k for k in varying_keys(list(base_runs.values()) + list(new_runs.values())) if k not in ignored]
    names = {k: setting_of(r, keys) for runs in (base_runs, new_runs) for k, r in runs.items()}
    paired = sorted(set(base_runs) & set(new_runs), key=lambda k: names[k])
    rows: list[dict] = []
    for key in paired:
        rows.extend(compare_pair(base_runs[key], new_runs[key], limits, name=names[key]))
        rows.extend(identity_unknown(names[key], base_runs[key], new_runs[key]))
    for key in sorted(set(new_runs) - set(base_runs), key=lambda k: names[k]):
        run = new_runs[key]
        if run["metrics"].get("status") != "ok":
            rows.append(_row(names[key], {}, run, "status", "status", new=run["metrics"].get("status"),
                             source="a failed run in NEW (not in BASE)", verdict="regression",
                             note=f"failed in NEW: {run['metrics'].get('error') or 'no error recorded'}"))
    for folder, reason in corrupt_new:
        rows.append(_row(f"NEW run folder {folder}", {}, None, "run folder", "corrupt", new=reason,
                         source="corrupt files in NEW", verdict="regression", note=reason))
    for folder, reason in corrupt_base:  # its setting cannot be gated: never a silent pass
        rows.append(_row(f"BASE run folder {folder}", {}, None, "run folder", "corrupt", base=reason,
                         source="corrupt files in BASE", verdict="regression",
                         note=f"BASE run folder {folder} cannot be read ({reason}): its setting is not gated"))
    corrupt_names = {folder for folder, _ in corrupt_new}
    missing = [k for k in sorted(set(base_runs) - set(new_runs), key=lambda k: names[k])
               if base_runs[k]["metrics"].get("status") == "ok"
               and os.path.basename(base_runs[k]["run_dir"]) not in corrupt_names]  # a corrupt one is named above
    for key in missing:
        run = base_runs[key]
        rows.append(_row(names[key], run, None, "run", "missing", base="ok", new="missing",
                         source="--allow-missing" if allow_missing else "a BASE run with no finished NEW run",
                         verdict="ok" if allow_missing else "regression",
                         note=f"missing in NEW (BASE folder {os.path.basename(run['run_dir'])})"
                              + (": allowed by --allow-missing" if allow_missing else "")))
    only = {side: sorted(names[k] + f" ({os.path.basename(runs[k]['run_dir'])})" for k in set(runs) - set(other))
            for side, runs, other in (("only_base", base_runs, new_runs), ("only_new", new_runs, base_runs))}
    regressions = [r for r in rows if r["verdict"] == "regression"]
    inconclusive = [r for r in rows if r["verdict"] == "inconclusive"]
    gate = "regression" if regressions else ("inconclusive" if inconclusive else "pass")
    return {"ok": gate == "pass", "gate": gate, "pairs": len(paired), "missing": len(missing),
            "allow_missing": allow_missing, "regressions": regressions, "inconclusive": inconclusive,
            "warnings": [r for r in rows if r["verdict"] == "warning"], "rows": rows, "ignored_keys": ignored,
            "corrupt_new": [list(c) for c in corrupt_new], "corrupt_base": [list(c) for c in corrupt_base],
            "limits": vars(limits), **only}


# Keys of the result config that say which data and method files a run read (kvbench.reporting.runs): a side that
# lacks one cannot be shown to have read the same inputs, so a pair made without it is never a pass.
IDENTITY_KEYS = ("data_revision", "data_sha256", "method_files_sha256")


def identity_unknown(name: str, base: dict, new: dict) -> list[dict]:
    """An inconclusive row when a pair was made on the shared keys and one side records a data or method-file
    identity (hub revision, local data digest, method files digest) that the other lacks."""
    in_base, in_new = ({k.split(".")[0] for k in result_keys(run)} for run in (base, new))
    keys = sorted(k for k in in_base ^ in_new if k in IDENTITY_KEYS)
    if not keys:
        return []
    sides = ", ".join(f"{k} in {'BASE' if k in in_base else 'NEW'} only" for k in keys)
    return [_row(name, base, new, "inputs", "identity", base=None, new=None, source="paired on the shared keys",
                 verdict="inconclusive",
                 note=f"{sides}: the two runs may have read different data or method files, so their scores are "
                      "not a comparison of one setting (rerun BASE with this version)")]


def pair_on_shared_keys(base_runs: dict[str, dict], new_runs: dict[str, dict]) -> tuple[dict, dict, list[str]]:
    """Pair the runs left unpaired by their full config on the config keys that both sides know: a version that
    adds a setting (with its default) to every config still pairs with the runs made before it. Returns both sides
    re-keyed and the keys ignored (present on one side only)."""
    left_base = {k: r for k, r in base_runs.items() if k not in new_runs}
    left_new = {k: r for k, r in new_runs.items() if k not in base_runs}
    if not left_base or not left_new:
        return base_runs, new_runs, []
    known_base = set().union(*(result_keys(r) for r in base_runs.values()))
    known_new = set().union(*(result_keys(r) for r in new_runs.values()))
    shared = known_base & known_new
    ignored = sorted(known_base ^ known_new)
    if not ignored:
        return base_runs, new_runs, []
    by_base = {pair_key(r, shared): k for k, r in left_base.items()}
    by_new = {pair_key(r, shared): k for k, r in left_new.items()}
    base_out, new_out = dict(base_runs), dict(new_runs)
    for loose in set(by_base) & set(by_new):
        key = "shared-" + loose
        base_out[key] = base_out.pop(by_base[loose])
        new_out[key] = new_out.pop(by_new[loose])
    return base_out, new_out, ignored


def differing_settings(base_runs: dict[str, dict], new_runs: dict[str, dict], limit: int = 3) -> list[str]:
    """The config keys whose values differ between the two sides, as "key: base values vs new values"."""
    out = []
    for key in varying_keys(list(base_runs.values()) + list(new_runs.values())):
        vb = sorted({repr(r["cfg"].get(key)) for r in base_runs.values()})
        vn = sorted({repr(r["cfg"].get(key)) for r in new_runs.values()})
        if vb != vn:
            out.append(f"{key} {'/'.join(vb)} vs {'/'.join(vn)}")
    return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])


# --------------------------------------------------------------------------- Markdown
def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e9):
            return f"{value:.3e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}" if value.is_integer() else f"{value:,.1f}"
        return f"{value:.5g}"
    return str(value)


def _change(row: dict) -> str:
    if row["change"] is None:
        return ""
    p = row["change_pct"]
    pct = "" if p is None else f"{p:+.1e}%" if 0 < abs(p) < 0.01 else f"{p:+.2f}%"
    if row["kind"] == "speed":
        return pct
    return f"{row['change']:+.4g}" + (f" ({pct})" if pct else "")


def _tolerance(row: dict) -> str:
    if row["tolerance"] is None:
        return ""
    if row["kind"] == "speed":
        return f"{row['tolerance']:.0%} slowdown"
    return _fmt(float(row["tolerance"]))


def _interval(row: dict) -> str:
    """The 95% interval of a score's change, as NEW - BASE: `[-0.05, +0.2]`."""
    if not row.get("interval"):
        return ""
    lo, hi = row["interval"]
    return f"[{lo:+.4g}, {hi:+.4g}]"


def _line(row: dict) -> str:
    """One line naming a regression, an inconclusive score or a warning: the run, the metric, what happened."""
    if row["kind"] in ("status", "corrupt", "missing", "samples", "identity") or isinstance(row["new"], str) or \
            (row["tolerance"] is None and row["note"]):
        what = _escape(row["note"])  # NEW's error text among others: never a link, an image or a line break
    elif row["kind"] == "speed":
        what = f"{row['metric']} {_fmt(row['base'])} -> {_fmt(row['new'])} ({_change(row)}, {row['note']}; " \
               f"limit {row['tolerance']:.0%} slowdown)"
    elif row.get("interval"):
        what = f"{row['metric']} {_fmt(row['base'])} -> {_fmt(row['new'])} ({_change(row)}; 95% interval " \
               f"{_interval(row)}, {row['source']}; min effect {_fmt(float(row['min_effect']))})" \
               + (f"; {_escape(row['note'])}" if row["note"] else "")
    else:
        what = f"{row['metric']} {_fmt(row['base'])} -> {_fmt(row['new'])} ({_change(row)}; tolerance " \
               f"{_tolerance(row)}, {row['source']})"
    return f"{_escape(row['run'])}: {what}"


KIND_ORDER = {"status": 0, "corrupt": 0, "missing": 0, "samples": 0, "identity": 0, "score": 1, "failures": 2, "memory": 3, "speed": 4}
VERDICT_MARK = {"regression": "REGRESSION", "inconclusive": "INCONCLUSIVE", "warning": "warning", "better": "better",
               "ok": "ok"}
GATE_MARK = {"pass": "**PASS**", "regression": "**FAIL**", "inconclusive": "**INCONCLUSIVE**"}


def to_markdown(verdict: dict, base_label: str, new_label: str) -> str:
    regs, warns = verdict["regressions"], verdict["warnings"]
    unsure = verdict.get("inconclusive", [])
    gate = verdict.get("gate") or ("pass" if verdict["ok"] else "regression")
    lines = [f"## kvbench-compare: {_escape(base_label)} -> {_escape(new_label)}", "",
             f"{verdict['pairs']} paired runs, {verdict.get('missing', 0)} missing in NEW"
             + (" (allowed)" if verdict.get("allow_missing") and verdict.get("missing") else "")
             + f", {len(regs)} regressions, {len(unsure)} inconclusive, {len(warns)} warnings: "
             + GATE_MARK[gate], ""]
    notes = [f"- REGRESSION: {_line(r)}" for r in regs] + [f"- INCONCLUSIVE: {_line(r)}" for r in unsure]
    notes += [f"- warning: {_line(r)}" for r in warns]
    if any(r["kind"] == "speed" for r in warns):
        notes.append("- speeds are not gated (single-shot timings on a shared machine); --gate-speed gates them")
    lines += notes + ([""] if notes else [])
    lim = verdict.get("limits") or {}
    if lim:
        lines += [f"Limits: a score regresses when the 95% interval of its change (a bootstrap, paired when both "
                  f"runs scored the same items; at least relative {lim['rel_tol']:g} wide) excludes no change and "
                  f"the change reaches --min-effect {lim.get('min_effect', DEFAULT_MIN_EFFECT):g} (relative; "
                  f"--max-drop {lim['max_drop']:g} in the metric's unit when larger); it is inconclusive when the "
                  f"interval holds both; speeds {lim['max_slowdown']:.0%} slowdown "
                  + ("(gated)" if lim["gate_speed"] else "(warning only)") + "."]
    by_run: dict[str, list[dict]] = {}
    for r in verdict["rows"]:
        by_run.setdefault(r["run"], []).append(r)
    for run, rows in by_run.items():
        lines += ["", f"### {_escape(run)}", "",
                  "| metric | base | new | change | 95% interval | min effect | source | verdict |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
        for r in sorted(rows, key=lambda r: KIND_ORDER.get(r["kind"], 9)):
            base = r["base"] if not isinstance(r["base"], str) or r["kind"] != "corrupt" else "corrupt"
            new = r["new"] if not isinstance(r["new"], str) or r["kind"] != "corrupt" else "corrupt"
            spread = _interval(r) or _tolerance(r)
            effect = _fmt(float(r["min_effect"])) if r.get("min_effect") is not None else ""
            lines.append(f"| {_escape(r['metric'])} | {_escape(_fmt(base))} | {_escape(_fmt(new))} | {_change(r)} | "
                         f"{spread} | {effect} | {_escape(r['source'])} | "
                         f"{VERDICT_MARK.get(r['verdict'], r['verdict'])} |")
    if verdict.get("ignored_keys"):
        lines += ["", "Paired without the config keys that only one side has: "
                  + ", ".join(_escape(k) for k in verdict["ignored_keys"])]
    for side, label in (("only_base", f"Only in {base_label}"), ("only_new", f"Only in {new_label}")):
        if verdict[side]:
            lines += ["", f"{_escape(label)} ({len(verdict[side])}):",
                      *[f"- {_escape(name)}" for name in verdict[side]]]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CLI
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvbench-compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="results folder of the base runs")
    p.add_argument("new", nargs="?", help="results folder of the new runs (default: BASE, with --new-commit)")
    p.add_argument("--base-commit", help="only BASE's runs logged at this git commit (prefix)")
    p.add_argument("--new-commit", help="only NEW's runs logged at this git commit (prefix)")
    p.add_argument("--rel-tol", type=float, default=DEFAULT_REL_TOL,
                   help=f"tolerated relative move of a score without a wider bootstrap interval (default "
                        f"{DEFAULT_REL_TOL:g}: float noise)")
    p.add_argument("--max-drop", type=float, default=0.0,
                   help="the smallest change of a score worth flagging, in its unit (perplexity: in ppl), when "
                        "larger than --min-effect x |base| (default 0)")
    p.add_argument("--min-effect", type=float, default=DEFAULT_MIN_EFFECT,
                   help=f"the smallest relative change of a score worth flagging (default {DEFAULT_MIN_EFFECT:g} = "
                        f"{DEFAULT_MIN_EFFECT * 100:g}%%; perplexity: relative to ppl); a change the interval cannot "
                        "tell from it and from no change is inconclusive (exit 3)")
    p.add_argument("--gate-speed", action="store_true",
                   help="a slowdown beyond --max-slowdown is a regression (default: a warning)")
    p.add_argument("--max-slowdown", type=float, default=DEFAULT_MAX_SLOWDOWN,
                   help=f"tolerated loss of speed as a fraction (default {DEFAULT_MAX_SLOWDOWN} = "
                        f"{DEFAULT_MAX_SLOWDOWN * 100:.0f}%%: half the tokens per second or twice the latency)")
    p.add_argument("--allow-missing", action="store_true",
                   help="a BASE run with no finished NEW counterpart is listed, not a regression (NEW is a "
                        "deliberate subset)")
    p.add_argument("--json", metavar="PATH", help="write the verdict as JSON")
    return p.parse_args(argv)


def _check_limits(args: argparse.Namespace) -> None:
    for name, value, upper in (("--rel-tol", args.rel_tol, None), ("--max-drop", args.max_drop, None),
                               ("--max-slowdown", args.max_slowdown, 1.0)):
        if not math.isfinite(value) or value < 0 or (upper is not None and value >= upper):
            bound = f"a number >= 0 and < {upper:g}" if upper is not None else "a number >= 0"
            raise UserError(f"invalid {name}={value!r}: expected {bound}")
    if not math.isfinite(args.min_effect) or args.min_effect <= args.rel_tol:
        raise UserError(f"invalid --min-effect={args.min_effect!r}: expected a number above --rel-tol "
                        f"({args.rel_tol:g}): a smaller effect than float noise can never be resolved")


def check_json_path(path: str) -> None:
    """--json must name a file in an existing, writable folder: one line before anything is compared or printed."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path) or path.endswith(os.sep):
        raise UserError(f"--json {path!r} is a folder: give a file path (e.g. verdict.json)")
    if not os.path.isdir(folder):
        raise UserError(f"--json {path!r}: no folder {folder!r}")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UserError(f"--json {path!r}: not writable")


def load_run_folder(path: str, name: str) -> dict:
    """One run folder (its metrics.json and config.yaml) as a run record; one-line UserError when it is not one."""
    if not os.path.isdir(path):
        raise UserError(f"no run folder {path!r} ({name})")
    metrics = read_json(os.path.join(path, "metrics.json"))
    if metrics is None or not metrics.get("run_id"):
        raise UserError(f"{path!r} ({name}) is not a run folder: no readable metrics.json (give a run's folder, "
                        "e.g. results/<run_id>)")
    return make_run(os.path.dirname(os.path.abspath(path)), metrics, run_dir=path)


def pair_main(argv: list[str]) -> int:
    """kvbench-compare --pair RUN_A RUN_B: the paired verdict of two runs (module docstring)."""
    p = argparse.ArgumentParser(prog="kvbench-compare --pair",
                                description="A paired verdict of run A against run B over their shared samples.")
    p.add_argument("--pair", nargs=2, metavar=("RUN_A", "RUN_B"), required=True, help="two run folders")
    p.add_argument("--metric", help="the score to compare (default: the task's headline metric)")
    p.add_argument("--min-effect", type=float, default=DEFAULT_MIN_EFFECT,
                   help=f"the smallest relative change worth telling from none (default {DEFAULT_MIN_EFFECT:g})")
    p.add_argument("--json", metavar="PATH", help="write the verdict as JSON")
    args = p.parse_args(argv)
    if not math.isfinite(args.min_effect) or args.min_effect < 0:
        raise UserError(f"invalid --min-effect={args.min_effect!r}: expected a number >= 0")
    if args.json is not None:
        check_json_path(args.json)
    run_a, run_b = (load_run_folder(path, name) for path, name in zip(args.pair, ("RUN_A", "RUN_B")))
    if args.metric is not None and not stats.is_score(args.metric):
        raise UserError(f"--metric {args.metric!r} is not a score: choices are the scores the runs recorded ("
                        + ", ".join(k for k in run_a["metrics"] if stats.is_score(k)) + ")")
    try:
        verdict = pair_verdict(run_a, run_b, args.metric, args.min_effect)
    except NotPaired as exc:
        raise UserError(f"kvbench-compare --pair: {exc}") from None
    print(verdict_line(verdict))
    if args.json:
        write_json(args.json, verdict)
    if verdict["verdict"] == "missing":
        return EXIT_REGRESSION
    return EXIT_INCONCLUSIVE if verdict["verdict"] == "inconclusive" else EXIT_PASS


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--pair" in argv:
        return pair_main(argv)
    args = parse_args(argv)
    new_folder = args.new or args.base
    if args.new is None and not (args.base_commit and args.new_commit):
        raise UserError("give two results folders (BASE NEW), or one folder with --base-commit and --new-commit")
    _check_limits(args)
    if args.json is not None:
        check_json_path(args.json)
    if not os.path.isdir(new_folder):
        raise UserError(f"no results folder {new_folder!r} (NEW)")
    corrupt_base = corrupt_runs(args.base)
    corrupt_new = corrupt_runs(new_folder)
    base = select_runs(args.base, args.base_commit, frozenset(name for name, _ in corrupt_base))
    new = select_runs(new_folder, args.new_commit, frozenset(name for name, _ in corrupt_new))
    if not base:
        raise UserError(f"no runs in BASE {args.base!r} (run folders with a readable metrics.json)")
    if not new and not corrupt_new:
        raise UserError(f"no runs in NEW {new_folder!r} (run folders with a metrics.json): nothing to compare")
    limits = Limits(args.rel_tol, args.max_drop, args.max_slowdown, args.gate_speed, args.min_effect)
    verdict = compare(base, new, limits, corrupt_new=corrupt_new, corrupt_base=corrupt_base,
                      allow_missing=args.allow_missing)
    if verdict["pairs"] == 0 and all(r["kind"] == "missing" for r in verdict["regressions"]):
        differ = differing_settings(base, new)
        raise UserError(f"nothing paired: none of the {len(new)} runs in NEW has the setting of one of the "
                        f"{len(base)} runs in BASE" + (f" (differing: {'; '.join(differ)})" if differ else ""))
    label = (lambda folder, commit: folder + (f"@{commit}" if commit else ""))
    print(to_markdown(verdict, label(args.base, args.base_commit), label(new_folder, args.new_commit)), end="")
    if args.json:
        try:
            write_json(args.json, verdict)
        except OSError as exc:  # checked above; a folder that changed since then
            raise UserError(f"--json {args.json!r}: cannot write ({exc.strerror or exc})") from None
    return {"pass": EXIT_PASS, "regression": EXIT_REGRESSION, "inconclusive": EXIT_INCONCLUSIVE}[verdict["gate"]]


def cli() -> None:
    """Console entry point: exit 0 pass, 1 regression, 2 bad input (one line on stderr), 3 inconclusive."""
    exit_with(main)


if __name__ == "__main__":
    cli()
