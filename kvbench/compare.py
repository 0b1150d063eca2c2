"""`kvbench-compare BASE NEW` (also `python -m kvbench.compare`): a regression gate between two sets of runs.

    kvbench-compare results_main results_pr                       # two results folders
    kvbench-compare results --base-commit 1a2b3c --new-commit 4d5e6f   # two commits logged in one folder
    kvbench-compare BASE NEW --json verdict.json --max-slowdown 0.2 --max-drop 0.5

Runs are paired by the hash of their result-determining config without the code version
(kvbench.reporting.runs.pair_key); runs left over are paired on the config keys both sides know (a newer version
that adds a setting with its default still pairs; the keys ignored are listed). For each pair:
- a score (ppl, accuracy, score, score_<dataset>, rouge_*, lm-eval accuracies) regresses when it is worse than the
  base by more than its tolerance: the half-width (on the bad side) of the bootstrap 95% interval of the base's score
  over its per-sample scores in samples.jsonl, or --max-drop (in the metric's unit) if that is larger; without
  per-sample scores the tolerance is --max-drop (default 0: any drop);
- a speed (decode/prefill/output tokens per second) regresses when it falls by more than --max-slowdown (10%);
- peak_kv_bytes regresses when it grows;
- a run that finished in BASE and failed in NEW regresses.
Prints a Markdown table, writes the same as JSON with --json, lists runs present on one side only, and exits 1 on
any regression (0 otherwise; 2 on bad input).
"""
from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional

from kvbench.errors import UserError, exit_with
from kvbench.reporting import stats
from kvbench.reporting.runs import describe, load_runs, pair_key, result_keys, samples_of, setting_of, varying_keys


def select_runs(folder: str, commit: Optional[str] = None) -> dict[str, dict]:
    """Runs of a folder keyed by pair key: the latest attempt of each run folder, or, for a commit (prefix), the
    last attempt of each run logged in runs.jsonl at that commit."""
    if not os.path.isdir(folder):
        raise UserError(f"no results folder {folder!r}")
    if commit is None:
        runs = load_runs(folder)
    else:
        runs = [r for r in load_runs(folder, history=True)
                if str(r["metrics"].get("git_commit") or "").startswith(commit)]
        if not runs:
            commits = sorted({str(r["metrics"].get("git_commit"))[:10] for r in load_runs(folder, history=True)})
            raise UserError(f"no runs of commit {commit!r} in {folder}: commits there are {', '.join(commits) or '(none)'}")
    out: dict[str, dict] = {}
    for run in runs:  # a later attempt of the same setting replaces an earlier one
        out[pair_key(run)] = run
    return out


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def score_tolerance(name: str, base_run: dict, base_value: float, max_drop: float) -> tuple[float, str]:
    """How far a score may move the wrong way: max(bootstrap 95% half-width on the bad side, max_drop)."""
    samples = samples_of(base_run)
    if samples:
        fn = stats.statistic(name, samples, base_value)
        n = stats.sample_count(name, samples)
        if fn is not None and n >= 2:
            lo, hi = stats.bootstrap_interval(fn, n)
            width = (hi - base_value) if stats.lower_is_better(name) else (base_value - lo)
            width = max(width, 0.0)
            if width >= max_drop:
                return width, f"bootstrap 95% over {n} samples"
    return max_drop, "max-drop"


def compare_pair(base: dict, new: dict, *, max_drop: float, max_slowdown: float,
                 name: Optional[str] = None) -> list[dict]:
    """One row per compared metric of a paired run: base, new, change, tolerance, verdict (ok|regression|better)."""
    bm, nm = base["metrics"], new["metrics"]
    name = name or describe(new)
    rows: list[dict] = []
    if bm.get("status") == "ok" and nm.get("status") != "ok":
        return [{"run": name, "metric": "status", "base": "ok", "new": nm.get("status"), "change": None,
                 "tolerance": None, "rule": str(nm.get("error") or ""), "verdict": "regression",
                 "base_run": base["run_dir"], "new_run": new["run_dir"]}]
    if bm.get("status") != "ok":
        return rows
    for key, bval in bm.items():
        b, n = _number(bval), _number(nm.get(key))
        if b is None or n is None:
            continue
        if stats.is_score(key):
            tol, rule = score_tolerance(key, base, b, max_drop)
            worse = (n - b) if stats.lower_is_better(key) else (b - n)
            verdict = "regression" if worse > tol + 1e-12 * max(1.0, abs(b)) else \
                ("better" if worse < -tol - 1e-12 * max(1.0, abs(b)) else "ok")
        elif key in stats.SPEED:
            if b <= 0:
                continue
            tol, rule = max_slowdown, f"slowdown <= {max_slowdown:.0%}"
            worse = (b - n) / b
            verdict = "regression" if worse > max_slowdown else ("better" if worse < -max_slowdown else "ok")
        elif key in stats.MEMORY:
            tol, rule = 0.0, "must not grow"
            worse = n - b
            verdict = "regression" if n > b else ("better" if n < b else "ok")
        else:
            continue
        rows.append({"run": name, "metric": key, "base": b, "new": n, "change": n - b, "tolerance": tol,
                     "rule": rule, "verdict": verdict, "base_run": base["run_dir"], "new_run": new["run_dir"]})
    return rows


def compare(base_runs: dict[str, dict], new_runs: dict[str, dict], *, max_drop: float = 0.0,
            max_slowdown: float = 0.10) -> dict:
    """The verdict as a JSON-ready dict: rows, regressions, runs only in base / only in new, ok."""
    base_runs, new_runs, ignored = pair_on_shared_keys(base_runs, new_runs)
    keys = [k for k in varying_keys(list(base_runs.values()) + list(new_runs.values())) if k not in ignored]
    names = {k: setting_of(r, keys) for runs in (base_runs, new_runs) for k, r in runs.items()}
    rows: list[dict] = []
    for key in sorted(set(base_runs) & set(new_runs), key=lambda k: names[k]):
        rows.extend(compare_pair(base_runs[key], new_runs[key], max_drop=max_drop, max_slowdown=max_slowdown,
                                 name=names[key]))
    only = {side: sorted(names[k] + f" ({os.path.basename(runs[k]['run_dir'])})" for k in set(runs) - set(other))
            for side, runs, other in (("only_base", base_runs, new_runs), ("only_new", new_runs, base_runs))}
    regressions = [r for r in rows if r["verdict"] == "regression"]
    return {"ok": not regressions, "pairs": len(set(base_runs) & set(new_runs)), "regressions": regressions,
            "rows": rows, "ignored_keys": ignored, **only}


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


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if abs(value) >= 1e5:
            return f"{value:.4g}"
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def to_markdown(verdict: dict, base_label: str, new_label: str) -> str:
    lines = [f"## kvbench-compare: {base_label} -> {new_label}", "",
             f"{verdict['pairs']} paired runs, {len(verdict['regressions'])} regressions: "
             + ("**PASS**" if verdict["ok"] else "**FAIL**"), ""]
    if verdict["rows"]:
        lines += ["| run | metric | base | new | change | tolerance | rule | verdict |",
                  "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
        order = {"regression": 0, "better": 1, "ok": 2}
        for r in sorted(verdict["rows"], key=lambda r: order.get(r["verdict"], 3)):
            mark = {"regression": "REGRESSION", "better": "better", "ok": "ok"}.get(r["verdict"], r["verdict"])
            lines.append(f"| {r['run']} | {r['metric']} | {_fmt(r['base'])} | {_fmt(r['new'])} | "
                         f"{_fmt(r['change'])} | {_fmt(r['tolerance'])} | {r['rule']} | {mark} |")
    if verdict.get("ignored_keys"):
        lines += ["", "Paired without the config keys that only one side has: "
                  + ", ".join(f"`{k}`" for k in verdict["ignored_keys"])]
    for side, label in (("only_base", f"Only in {base_label}"), ("only_new", f"Only in {new_label}")):
        if verdict[side]:
            lines += ["", f"{label} ({len(verdict[side])}):", *[f"- {name}" for name in verdict[side]]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvbench-compare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="results folder of the base runs")
    p.add_argument("new", nargs="?", help="results folder of the new runs (default: BASE, with --new-commit)")
    p.add_argument("--base-commit", help="only BASE's runs logged at this git commit (prefix)")
    p.add_argument("--new-commit", help="only NEW's runs logged at this git commit (prefix)")
    p.add_argument("--max-drop", type=float, default=0.0,
                   help="smallest tolerated drop of a score, in its unit (default 0; the bootstrap interval applies "
                        "when it is larger)")
    p.add_argument("--max-slowdown", type=float, default=0.10, help="tolerated fall in tok/s (default 0.10 = 10%%)")
    p.add_argument("--json", metavar="PATH", help="write the verdict as JSON")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    new_folder = args.new or args.base
    if args.new is None and not (args.base_commit and args.new_commit):
        raise UserError("give two results folders (BASE NEW), or one folder with --base-commit and --new-commit")
    for name, value in (("--max-drop", args.max_drop), ("--max-slowdown", args.max_slowdown)):
        if not math.isfinite(value) or value < 0:
            raise UserError(f"invalid {name}={value!r}: expected a number >= 0")
    base = select_runs(args.base, args.base_commit)
    new = select_runs(new_folder, args.new_commit)
    verdict = compare(base, new, max_drop=args.max_drop, max_slowdown=args.max_slowdown)
    label = (lambda folder, commit: folder + (f"@{commit}" if commit else ""))
    print(to_markdown(verdict, label(args.base, args.base_commit), label(new_folder, args.new_commit)), end="")
    if args.json:
        from kvbench.results import write_json

        write_json(args.json, verdict)
    return 0 if verdict["ok"] else 1


def cli() -> None:
    """Console entry point: exit 1 on a regression, 2 on bad input (one line on stderr)."""
    exit_with(main)


if __name__ == "__main__":
    cli()
