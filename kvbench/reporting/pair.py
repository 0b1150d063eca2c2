"""Method against method: a paired verdict on two runs over the same task and data, with a bootstrap interval.

    pair_verdict(run_a, run_b, metric=None, min_effect=0.01) -> dict     (run records: kvbench.store.runs)
    change_interval(metric, run, base) -> (lo, hi) or None               (the report's "vs full" intervals)
    verdict_line(verdict) -> "snapkv@0.5 vs expected_attention@0.5, score: -3.2 [-7.4, +1.1], inconclusive"

Any two runs may be set against each other (a different method, budget, ratio or model) when they ran the same
task on the same data: the same `task.*` settings, the same local data digest or hub revision, and samples over the
same items (same ids in the same order; for perplexity the same windows). Else `NotPaired` says why, in one line.

The change is A - B in the metric's unit; its 95% interval is a paired bootstrap over the shared items
(kvbench.reporting.stats.paired_interval: the items resampled together, so their own difficulty cancels). Against
`min_effect` (relative to B's value: 0.01 = 1%), the verdict is:
    no difference   the whole interval lies within +-min_effect (identical runs: [0, 0]);
    A better / worse the interval excludes no change (and is not within +-min_effect); named with A's label;
    inconclusive    the interval holds both no change and a change of min_effect (or no interval could be drawn:
                    the runs kept no per-sample records);
    missing         a run failed, or its metric is missing, null, NaN or inf: never a pass.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from kvbench.reporting import stats
from kvbench.store.runs import samples_of

DEFAULT_MIN_EFFECT = 0.01
RESOLVED = ("no difference", "better", "worse")


class NotPaired(ValueError):
    """The two runs did not score the same items: no paired verdict exists (the message is one line)."""


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def label(run: dict) -> str:
    """method[+codec]@ratio (or @budget; @full for no limit), with the model when asked: "snapkv@0.5"."""
    m, cfg = run["metrics"], run["cfg"]
    method = str(cfg.get("method.name") or m.get("method") or "?")
    quant = cfg.get("quant.name") or m.get("quant")
    if quant not in (None, "none", "full"):
        method += f"+{quant}"
    ratio, budget = cfg.get("compression_ratio", m.get("compression_ratio")), cfg.get("budget", m.get("budget"))
    threshold = cfg.get("method.threshold")
    if m.get("evicts") is False or method == "full":
        return method
    if threshold is not None:
        return f"{method}@t{threshold:g}" if isinstance(threshold, (int, float)) else f"{method}@t{threshold}"
    if ratio is not None:
        return f"{method}@{ratio:g}" if isinstance(ratio, (int, float)) else f"{method}@{ratio}"
    return f"{method}@{budget}" if budget is not None else method


def labels(run_a: dict, run_b: dict) -> tuple[str, str]:
    """Each run's label, with its model when the models differ (or the labels would be equal)."""
    la, lb = label(run_a), label(run_b)
    ma, mb = (str(r["metrics"].get("model") or r["cfg"].get("model.name") or r["cfg"].get("model.path"))
              for r in (run_a, run_b))
    if ma != mb or la == lb:
        la, lb = f"{la} ({ma})", f"{lb} ({mb})"
    if la == lb:  # same setting and model: tell them apart by folder
        la, lb = (f"{x} [{r.get('run_id') or r['run_dir']}]" for x, r in ((la, run_a), (lb, run_b)))
    return la, lb


def _data_of(run: dict) -> dict:
    m, cfg = run["metrics"], run["cfg"]
    out = {k: v for k, v in cfg.items() if k.startswith("task.")}
    for key in ("data_sha256", "data_revision"):
        value = m.get(key)
        if value is not None:
            out[key] = value
    if not out:  # no config.yaml: the task name as recorded
        out["task.name"] = m.get("task")
    return out


def check_same_data(run_a: dict, run_b: dict) -> None:
    """Raise NotPaired when the runs ran different tasks, task settings or data files."""
    da, db = _data_of(run_a), _data_of(run_b)
    differ = [k for k in sorted(set(da) | set(db)) if repr(da.get(k)) != repr(db.get(k))]
    if differ:
        key = differ[0]
        raise NotPaired(f"not the same task and data: {key} is {da.get(key)!r} in A and {db.get(key)!r} in B"
                        + (f" ({len(differ) - 1} more setting(s) differ)" if len(differ) > 1 else ""))


def headline(run: dict) -> Optional[str]:
    """The task's headline metric of a run (its `score`, `ppl`, `accuracy`, ...)."""
    m = run["metrics"]
    return stats.primary_metric(run["cfg"].get("task.name") or m.get("task"), m)


def change_interval(metric: str, run: dict, base: dict) -> Optional[tuple[float, float]]:
    """The paired bootstrap 95% interval of run's metric - base's, over the items both scored; None when they did
    not score the same items or kept no per-sample records."""
    a, b = _number(run["metrics"].get(metric)), _number(base["metrics"].get(metric))
    sa, sb = samples_of(run), samples_of(base)
    if a is None or b is None or not sa or not sb:
        return None
    got = stats.paired_interval(metric, sb, sa, b, a)  # of A - B
    return None if got is None else (got[0], got[1])


def pair_verdict(run_a: dict, run_b: dict, metric: Optional[str] = None,
                 min_effect: float = DEFAULT_MIN_EFFECT) -> dict:
    """The paired verdict of A against B (see the module docstring) as a JSON-ready dict: labels, metric, a, b,
    change (A - B), interval, items, unit, min_effect (in the metric's unit), verdict, why. Raises NotPaired when
    the runs did not run the same task on the same data."""
    check_same_data(run_a, run_b)
    metric = metric or headline(run_a) or headline(run_b)
    la, lb = labels(run_a, run_b)
    out: dict = {"a": la, "b": lb, "metric": metric, "a_value": None, "b_value": None, "change": None,
                 "interval": None, "items": 0, "unit": "samples", "min_effect": None, "verdict": "missing", "why": ""}
    for name, run in (("A", run_a), ("B", run_b)):
        if run["metrics"].get("status") != "ok":
            out["why"] = f"{name} failed: {run['metrics'].get('error') or 'no error recorded'}"
            return out
    if metric is None:
        out["why"] = "no score in either run"
        return out
    a, b = _number(run_a["metrics"].get(metric)), _number(run_b["metrics"].get(metric))
    out["a_value"], out["b_value"] = a, b
    if a is None or b is None:
        which = " and ".join(n for n, v in (("A", a), ("B", b)) if v is None)
        out["why"] = f"{metric} is missing, null, NaN or inf in {which}"
        return out
    sa, sb = samples_of(run_a), samples_of(run_b)
    if sa and sb and not stats.aligned(metric, sb, sa):
        raise NotPaired(f"not the same items: A scored {len(sa)} samples, B {len(sb)}"
                        + (" (their perplexity windows differ: another tokenizer?)" if len(sa) == len(sb) and
                           [s.get("id") for s in sa] == [s.get("id") for s in sb] else " (ids differ)"))
    effect = min_effect * abs(b)
    out.update(change=a - b, min_effect=effect)
    got = change_interval(metric, run_a, run_b)
    if got is None:
        out["verdict"] = "inconclusive"
        n = stats.sample_count(metric, sb) if sa and sb else 0
        out["why"] = ("no per-sample records to draw an interval from" if not (sa and sb) else
                      f"{n} item: no interval" if n < 2 else "the per-sample records do not recompute the metric")
        return out
    lo, hi = got
    out.update(interval=[lo, hi], items=stats.sample_count(metric, sb), unit=stats.sample_unit(metric, sb))
    higher_better = not stats.lower_is_better(metric)
    if -effect <= lo and hi <= effect:
        out["verdict"] = "no difference"
    elif lo > 0 or hi < 0:
        out["verdict"] = "better" if (lo > 0) == higher_better else "worse"
    else:
        out["verdict"] = "inconclusive"
    return out


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4g}"


def verdict_line(v: dict) -> str:
    """One line: "A vs B, metric: change [lo, hi], verdict" (what the verdict rests on after it)."""
    head = f"{v['a']} vs {v['b']}, {v['metric']}"
    if v["verdict"] == "missing":
        return f"{head}: missing ({v['why']})"
    interval = f" [{v['interval'][0]:+.3g}, {v['interval'][1]:+.3g}]" if v["interval"] else ""
    verdict = f"{v['a']} {v['verdict']}" if v["verdict"] in ("better", "worse") else v["verdict"]
    detail = (f"{_num(v['a_value'])} vs {_num(v['b_value'])}; 95% paired bootstrap over {v['items']} {v['unit']}; "
              f"min effect {_num(v['min_effect'])}") if v["interval"] else v["why"]
    return f"{head}: {v['change']:+.3g}{interval}, {verdict} ({detail})"
