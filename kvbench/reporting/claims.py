"""An experiment's `paper:` block: checked (one-line UserError on a bad block), and its claims judged on the runs.

A claim is a relation between rows of the block (rows are named by `id`, or by `label`), in the paper's metric:

    claims:
      - claim: "fp16 < nuq3 + 1% outliers < nuq3 < int3"
        order: [fp16, nuq3_1pct, nuq3, int3]     # best first (lower ppl first when lower_is_better)
        strict: true                             # default; false: ties allowed (best <= next ...)
      - claim: "nuq3 + 1% outliers within 2% of fp16"
        ratio: [nuq3_1pct, fp16]                 # value(first) / value(second)
        max: 1.02                                # and/or min:
        metric: ppl                              # optional: default the block's metric
        where: {task.name: perplexity}           # optional: only runs with these config values

`judge(claim, paper, runs)` finds the runs of each row (the row's `match` on the run's config; the runs of the
row's own `model` when there are some), splits them into comparable settings (the swept keys the rows do not
fix, e.g. budget x block size; a run whose value of such a key is null, like `full`'s budget, joins every
setting), and evaluates the relation in each setting where every row ran, on a 95% bootstrap interval, never on
point values alone: paired over the items the rows share (samples, perplexity windows: one resampling serves every
row) when each row has one run on the same items, else each run resampled on its own (stats.row_draws). A ratio
claim is judged on the interval of the ratio, an order claim on each neighbouring pair's difference. In a setting:
"reproduced" (the whole interval on the claim's side), "not reproduced" (the whole interval on the other side, or
a row's run has no finite value), "inconclusive" (the interval reaches both sides: the data cannot tell). A claim:
not reproduced if any setting is, reproduced if every setting is, else inconclusive; "not run" when some row has no
run in any setting. The interval and the items resampled are printed beside each claim (a run whose samples cannot
recompute its value, e.g. one document without windows, counts at its value: the items say so). The paper's own
figure for the relation is computed from the published values (unknown when a value is null); a claim the
published values contradict is refused as a bad block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from kvbench.errors import UserError
from kvbench.reporting import stats
from kvbench.reporting.runs import fmt, varying_keys
from kvbench.store.runs import samples_of

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_RUN = "reproduced", "not reproduced", "inconclusive", "not run"
PAPER_KEYS = {"source", "model", "dataset", "metric", "lower_is_better", "setting", "note", "rows", "claims",
              "data_match"}
ROW_KEYS = {"id", "label", "match", "value", "model", "per_dataset", "note"}
CLAIM_KEYS = {"claim", "order", "ratio", "min", "max", "strict", "metric", "where", "note"}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bad(where: str, what: str) -> UserError:
    return UserError(f"bad paper block of experiment {where}: {what}")


def row_name(row: dict) -> str:
    return str(row.get("id") or row.get("label"))


def validate_paper(paper: Any, experiment: str) -> dict:
    """The block itself when it is well formed; else a one-line UserError naming the bad value."""
    if not isinstance(paper, dict):
        raise _bad(experiment, f"expected a mapping with {', '.join(sorted(PAPER_KEYS))}, got {paper!r}")
    unknown = set(paper) - PAPER_KEYS
    if unknown:
        raise _bad(experiment, f"unknown key(s) {', '.join(sorted(map(str, unknown)))}: "
                               f"valid keys are {', '.join(sorted(PAPER_KEYS))}")
    if not isinstance(paper.get("metric"), str) or not paper["metric"]:
        raise _bad(experiment, f"metric must be a metrics.json key (a string), got {paper.get('metric')!r}")
    if "lower_is_better" in paper and not isinstance(paper["lower_is_better"], bool):
        raise _bad(experiment, f"lower_is_better must be true or false, got {paper['lower_is_better']!r}")
    if paper.get("data_match") is not None and not isinstance(paper["data_match"], dict):
        raise _bad(experiment, f"data_match must map config keys to values, got {paper['data_match']!r}")
    rows = paper.get("rows")
    if rows is None:
        rows = []
    if not isinstance(rows, list):
        raise _bad(experiment, f"rows must be a list, got {rows!r}")
    names: dict[str, dict] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise _bad(experiment, f"row {i} must be a mapping, got {row!r}")
        label = row.get("label")
        if not isinstance(label, str) or not label:
            raise _bad(experiment, f"row {i} needs a label (a string), got {label!r}")
        if set(row) - ROW_KEYS:
            raise _bad(experiment, f"row {label!r}: unknown key(s) {', '.join(sorted(map(str, set(row) - ROW_KEYS)))}"
                                   f": valid keys are {', '.join(sorted(ROW_KEYS))}")
        if not isinstance(row.get("match"), dict) or not row["match"]:
            raise _bad(experiment, f"row {label!r}: match must map config keys to values, got {row.get('match')!r}")
        value = row.get("value")
        if value is not None and not _is_number(value):
            raise _bad(experiment, f"row {label!r}: value must be a finite number or null (unknown), got {value!r}")
        for ds, v in (row.get("per_dataset") or {}).items():
            if not _is_number(v):
                raise _bad(experiment, f"row {label!r}: per_dataset {ds} must be a finite number, got {v!r}")
        for name in {row_name(row), label}:
            if name in names and names[name] is not row:
                raise _bad(experiment, f"two rows are named {name!r} (give them distinct ids)")
            names[name] = row
    claims = paper.get("claims") or []
    if not isinstance(claims, list):
        raise _bad(experiment, f"claims must be a list, got {claims!r}")
    for claim in claims:
        _validate_claim(claim, names, paper, experiment)
    return paper


def _validate_claim(claim: Any, names: dict, paper: dict, experiment: str) -> None:
    if not isinstance(claim, dict) or not isinstance(claim.get("claim"), str) or not claim["claim"]:
        raise _bad(experiment, f"each claim needs `claim:` (its text), got {claim!r}")
    text = claim["claim"]
    if set(claim) - CLAIM_KEYS:
        raise _bad(experiment, f"claim {text!r}: unknown key(s) {', '.join(sorted(map(str, set(claim) - CLAIM_KEYS)))}"
                               f": valid keys are {', '.join(sorted(CLAIM_KEYS))}")
    kinds = [k for k in ("order", "ratio") if k in claim]
    if len(kinds) != 1:
        raise _bad(experiment, f"claim {text!r} needs exactly one of order: [rows best first] or "
                               "ratio: [row, base row]")
    refs = claim[kinds[0]]
    size_ok = isinstance(refs, list) and (len(refs) >= 2 if kinds[0] == "order" else len(refs) == 2)
    if not size_ok:
        raise _bad(experiment, f"claim {text!r}: {kinds[0]} must be a list of "
                               f"{'two or more rows' if kinds[0] == 'order' else 'two rows [row, base]'}, got {refs!r}")
    for ref in refs:
        if str(ref) not in names:
            raise _bad(experiment, f"claim {text!r} names row {ref!r}: rows are {', '.join(sorted(names)) or 'none'}")
    if kinds[0] == "ratio":
        bounds = {k: claim[k] for k in ("min", "max") if k in claim}
        if not bounds or not all(_is_number(v) for v in bounds.values()):
            raise _bad(experiment, f"claim {text!r}: a ratio needs min and/or max (numbers), got {bounds or None!r}")
    elif "min" in claim or "max" in claim:
        raise _bad(experiment, f"claim {text!r}: min/max belong to ratio claims, not to order")
    if "strict" in claim and not isinstance(claim["strict"], bool):
        raise _bad(experiment, f"claim {text!r}: strict must be true or false, got {claim['strict']!r}")
    if "where" in claim and not isinstance(claim["where"], dict):
        raise _bad(experiment, f"claim {text!r}: where must map config keys to values, got {claim['where']!r}")
    if "metric" in claim and (not isinstance(claim["metric"], str) or not claim["metric"]):
        raise _bad(experiment, f"claim {text!r}: metric must be a metrics.json key, got {claim['metric']!r}")
    published = [names[str(r)].get("value") for r in refs]
    if all(v is not None for v in published) and claim.get("metric", paper["metric"]) == paper["metric"]:
        holds, _ = relation(claim, published, _lower(claim, paper))
        if not holds:
            raise _bad(experiment, f"claim {text!r} does not hold for the paper's own values "
                                   f"({', '.join(fmt(v) for v in published)})")


def _lower(claim: dict, paper: dict) -> bool:
    metric = claim.get("metric") or paper["metric"]
    if metric == paper["metric"] and "lower_is_better" in paper:
        return bool(paper["lower_is_better"])
    return stats.lower_is_better(metric)


def relation(claim: dict, values: list[float], lower_is_better: bool) -> tuple[bool, str]:
    """Whether the values (one per referenced row) satisfy the claim, and the figure that shows it."""
    if "ratio" in claim:
        a, b = values
        if b == 0:
            return False, "x inf (base is 0)"
        r = a / b
        ok = ("min" not in claim or r >= claim["min"]) and ("max" not in claim or r <= claim["max"])
        return ok, f"x{r:.4g}"
    strict = claim.get("strict", True)
    ok, parts = True, [fmt(values[0], 4)]
    for prev, cur in zip(values, values[1:]):
        better = prev < cur if lower_is_better else prev > cur
        tie = prev == cur
        ok = ok and (better or (tie and not strict))
        parts.append(("=" if tie else "<" if prev < cur else ">") + " " + fmt(cur, 4))
    return ok, " ".join(parts)


def expected(claim: dict, lower_is_better: bool) -> str:
    """The relation in words, e.g. "x <= 1.02" or "ascending"."""
    if "ratio" in claim:
        b = [f">= {claim['min']:g}" if "min" in claim else "", f"<= {claim['max']:g}" if "max" in claim else ""]
        return "ratio " + " and ".join(x for x in b if x)
    rel = ("<" if lower_is_better else ">") + ("" if claim.get("strict", True) else "=")
    return f"each {rel} the next"


@dataclass
class Verdict:
    """One claim judged: our figure beside the paper's, the verdict and why; the 95% interval it was judged on and
    the items resampled for it."""
    claim: str
    metric: str
    expected: str
    ours: str
    paper: str
    verdict: str
    why: str = ""
    # per comparable setting: (setting text, figure, verdict, interval text, items text, interval bounds)
    settings: list = field(default_factory=list)
    interval: str = ""
    items: str = ""

    def as_dict(self) -> dict:
        return {"claim": self.claim, "metric": self.metric, "expected": self.expected, "ours": self.ours,
                "interval": self.interval, "items": self.items, "paper": self.paper, "verdict": self.verdict,
                "why": self.why,
                "settings": [{"setting": s, "ours": f, "verdict": v, "holds": {REPRODUCED: True,
                                                                               NOT_REPRODUCED: False}.get(v),
                              "interval": i, "items": n, "bounds": [[x if math.isfinite(x) else None for x in pair]
                                                                    for pair in b]}
                             for s, f, v, i, n, b in self.settings]}


def _side(lo: float, hi: float, low: float, high: float, open_low: bool = False) -> str:
    """Where the interval [lo, hi] lies against the claim's region (low, high) (the low end open or closed):
    inside it, outside it, or across its edge."""
    above_low = lo > low if open_low else lo >= low
    inside = above_low and hi <= high
    outside = (hi <= low if open_low else hi < low) or lo > high
    return REPRODUCED if inside else NOT_REPRODUCED if outside else INCONCLUSIVE


def _g(value: float) -> str:
    return f"{value:.4g}"


def on_interval(claim: dict, draws: Any, names: list[str], lower_is_better: bool) -> tuple[str, str, list]:
    """The claim judged on bootstrap draws of each row's value ([rows, iters]): the verdict (reproduced when the
    95% interval lies wholly on the claim's side, not reproduced when wholly on the other, else inconclusive), the
    interval as text and its bounds. A ratio claim on the ratio; an order claim on each neighbouring pair's
    difference (next - previous: more than 0 when lower is better), all of which must hold."""
    if "ratio" in claim:
        a, b = draws
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(b != 0, a / np.where(b != 0, b, 1.0), np.inf)
        lo, hi = stats.percentile_interval(ratio)
        verdict = _side(lo, hi, claim.get("min", -math.inf), claim.get("max", math.inf))
        return verdict, f"x[{_g(lo)}, {_g(hi)}]", [[lo, hi]]
    strict = claim.get("strict", True)
    verdicts, texts, bounds = [], [], []
    for i in range(len(names) - 1):
        lo, hi = stats.percentile_interval(draws[i + 1] - draws[i])
        margin = (lo, hi) if lower_is_better else (-hi, -lo)  # > 0: the earlier row is better, as claimed
        verdicts.append(_side(margin[0], margin[1], 0.0, math.inf, open_low=strict))
        texts.append(f"{names[i + 1]}-{names[i]} [{lo:+.4g}, {hi:+.4g}]")
        bounds.append([lo, hi])
    verdict = (NOT_REPRODUCED if NOT_REPRODUCED in verdicts else
               REPRODUCED if all(v == REPRODUCED for v in verdicts) else INCONCLUSIVE)
    return verdict, "; ".join(texts), bounds


def items_text(info: dict, names: list[str]) -> str:
    """What the interval resampled: "paired over 16 windows", "unpaired, 20 samples per run", and the rows held
    at their value (no per-item data)."""
    unit = info["unit"]
    counts = [n for row in info["items"] for n in row]
    if info["paired"]:
        text = f"paired over {counts[0]} {unit}"
    else:
        spread = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
        text = f"unpaired, {spread} {unit[:-1] if max(counts) == 1 else unit} per run"
    if info["exact"]:
        held = ", ".join(names[i] for i in info["exact"])
        text += f"; no interval for {held} (fewer than 2 {unit}, or no samples.jsonl)"
    return text


def value_of(run: dict, key: str) -> Any:
    """A run's value of a dotted config key; `budget` as recorded (null for a method that does not evict)."""
    if key == "budget":
        return run["metrics"].get("budget", run["cfg"].get("budget"))
    return run["cfg"].get(key)


def runs_of_row(row: dict, runs: list[dict]) -> list[dict]:
    """The runs whose config satisfies the row's `match`; only those of the row's model when it has runs."""
    hits = [r for r in runs if all(r["cfg"].get(k) == v for k, v in row["match"].items())]
    own = [r for r in hits if row.get("model") and r["cfg"].get("model.path") == row["model"]]
    return own or hits


def claim_metric(claim: dict, paper: dict, runs: list[dict]) -> tuple[str, bool]:
    """The metric the claim is judged in, and whether it is the paper's: the claim's (or block's) metric when some
    run has it, else the runs' common headline metric (a stand-in, e.g. ppl for lm-eval accuracy at smoke scale)."""
    wanted = claim.get("metric") or paper["metric"]
    if any(_is_number(r["metrics"].get(wanted)) for r in runs) or not runs:
        return wanted, True
    heads = {stats.primary_metric(r["cfg"].get("task.name") or r["metrics"].get("task"), r["metrics"]) for r in runs}
    heads.discard(None)
    return (heads.pop(), False) if len(heads) == 1 else (wanted, True)


def _fits(run: dict, keys: list[str], setting: tuple) -> bool:
    return all(value_of(run, k) is None or value_of(run, k) == v for k, v in zip(keys, setting))


SIGNATURE_SKIP = ("runtime.threads", "model.cache_dir")


def signature(run: dict) -> tuple:
    """What must be equal for two runs to be compared: model, task and runtime settings and the seed."""
    return tuple(sorted((k, repr(v)) for k, v in run["cfg"].items()
                        if (k.startswith(("model.", "task.", "runtime.")) or k == "seed") and k not in SIGNATURE_SKIP))


def shared_runs(row: dict, runs: list[dict], others: list[dict]) -> list[dict]:
    """Runs of another experiment for a row this one lacks: a results folder keeps one run per result config, so
    e.g. budget_sweep's `full` perplexity run is the very run kvquant_ppl recorded when their settings are equal.
    Only runs with the model, task and runtime settings of one of this experiment's runs."""
    mine = {signature(r) for r in runs}
    return [r for r in runs_of_row(row, others) if signature(r) in mine]


def judge(claim: dict, paper: dict, runs: list[dict], others: Optional[list[dict]] = None) -> Verdict:
    """Evaluate one claim of a validated paper block on an experiment's runs (others: the rest of the folder, for
    a row whose identical run another experiment recorded)."""
    kind = "order" if "order" in claim else "ratio"
    names = {}
    for row in paper.get("rows") or []:
        names.setdefault(row["label"], row)
        names[row_name(row)] = row
    rows = [names[str(r)] for r in claim[kind]]
    where = claim.get("where") or {}
    pool = [r for r in runs if all(value_of(r, k) == v for k, v in where.items())]
    per_row = [runs_of_row(row, pool) for row in rows]
    borrowed = []
    for i, row in enumerate(rows):
        if not per_row[i] and others:
            foreign = [r for r in others if all(value_of(r, k) == v for k, v in where.items())]
            per_row[i] = shared_runs(row, pool, foreign)
            if per_row[i]:
                borrowed.append(f"{row['label']}: the identical run recorded under "
                                f"{', '.join(sorted({str(r['experiment']) for r in per_row[i]}))}")
    metric, own_metric = claim_metric(claim, paper, [r for rs in per_row for r in rs])
    lower = _lower(dict(claim, metric=metric), paper) if own_metric else stats.lower_is_better(metric)
    published = [row.get("value") for row in rows]
    if not own_metric:
        paper_fig = f"not comparable (paper reports {claim.get('metric') or paper['metric']})"
    elif any(v is None for v in published):
        paper_fig = "unknown (published values not available)"
    else:
        paper_fig = relation(claim, published, lower)[1]
    shown_metric = metric if own_metric else f"{metric} (stand-in; paper: {claim.get('metric') or paper['metric']})"
    out = Verdict(claim["claim"], shown_metric, expected(claim, lower), "", paper_fig, NOT_RUN)
    missing = [row["label"] for row, rs in zip(rows, per_row) if not rs]
    if missing:
        out.ours, out.why = "", f"no run of {', '.join(missing)}"
        return out
    fixed = {k for row in rows for k in row["match"]} | set(where)
    # comparable settings: the swept keys the rows leave free (a method's own options, e.g. streaming_llm's window
    # = budget - sinks, follow from its row and are not settings); budget as recorded (null: no eviction)
    keys = [k for k in varying_keys([r for rs in per_row for r in rs])
            if k not in fixed and k != "budget" and not k.startswith(("method.", "quant."))]
    if "budget" not in fixed and len({value_of(r, "budget") for rs in per_row for r in rs} - {None}) > 1:
        keys.append("budget")
    settings = sorted({tuple(value_of(r, k) for k in keys) for rs in per_row for r in rs
                       if all(value_of(r, k) is not None for k in keys)}, key=repr) or [tuple(None for _ in keys)]
    judged, skipped = [], []
    for setting in settings:
        label = ", ".join(f"{k}={fmt(v)}" for k, v in zip(keys, setting)) or "all runs"
        chosen = [[r for r in rs if _fits(r, keys, setting)] for rs in per_row]
        if not all(chosen):
            skipped.append(label)
            continue
        values, empty = [], []
        for row, rs in zip(rows, chosen):
            vals = [r["metrics"].get(metric) if r["metrics"].get("status") == "ok" else None for r in rs]
            if not all(_is_number(v) for v in vals):
                bad = next(r for r, v in zip(rs, vals) if not _is_number(v))
                state = bad["metrics"].get("status")
                why = f"status {state}" if state != "ok" else "null/NaN"
                empty.append(f"{row['label']} has no {metric} ({why}"
                             f" in {bad['metrics'].get('run_id')})")
                continue
            values.append(sum(vals) / len(vals))
        if empty:
            judged.append((label, "; ".join(empty), NOT_REPRODUCED, "", "", []))
            continue
        if stats.averages_tasks(metric) and len({stats.score_tasks(r["metrics"]) for rs in chosen for r in rs}) > 1:
            skipped.append(f"{label} ({metric} averages different tasks in the rows' runs)")
            continue
        names_ = [row_name(row) for row in rows]
        draws, info = stats.row_draws(metric, [[(r["metrics"][metric], samples_of(r)) for r in rs] for rs in chosen])
        verdict, interval, bounds = on_interval(claim, draws, names_, lower)
        judged.append((label, relation(claim, values, lower)[1], verdict, interval, items_text(info, names_), bounds))
    out.settings = judged
    if not judged:
        out.why = f"no setting where every row ran (settings with a row missing: {'; '.join(skipped)})"
        return out
    failed = [s for s in judged if s[2] == NOT_REPRODUCED]
    unsure = [s for s in judged if s[2] == INCONCLUSIVE]
    out.verdict = NOT_REPRODUCED if failed else INCONCLUSIVE if unsure else REPRODUCED
    if len(judged) == 1:
        out.ours, out.interval, out.items = judged[0][1], judged[0][3], judged[0][4]
    else:
        held = len(judged) - len(failed) - len(unsure)
        out.ours = f"holds in {held} of {len(judged)} settings" + (f", {len(unsure)} inconclusive" if unsure else "")
        out.interval = "; ".join(f"{s[0]}: {s[3]}" for s in judged[:3] if s[3]) + (" ..." if len(judged) > 3 else "")
        out.items = "; ".join(dict.fromkeys(s[4] for s in judged if s[4]))
    if failed and len(judged) > 1:
        out.why = "fails at " + "; ".join(f"{s[0]}: {s[1]}" for s in failed[:4]) + (" ..." if len(failed) > 4 else "")
    elif failed:
        out.why = (f"{out.expected} does not hold" + ("" if not failed[0][3] else
                                                      ": the 95% interval lies wholly on the other side"))
    elif unsure:
        out.why = "the 95% interval reaches both sides of the claim's bound: the data cannot tell"
    if skipped:
        out.why = ((out.why + "; " if out.why else "")
                   + f"not run at {len(skipped)} setting(s): {'; '.join(skipped[:3])}")
    if borrowed:
        out.why = (out.why + "; " if out.why else "") + "; ".join(borrowed)
    if not own_metric and out.verdict == REPRODUCED:
        out.why = ((out.why + "; " if out.why else "")
                   + f"judged in {metric}: the runs have no {claim.get('metric') or paper['metric']}")
    return out


def experiment_verdict(verdicts: list[Verdict]) -> tuple[str, str]:
    """The experiment's verdict and a count: not reproduced when any claim is refuted, reproduced only when every
    claim is, not run when none ran, else inconclusive."""
    if not verdicts:
        return "no claims", "the paper block states no claims"
    kinds = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, NOT_RUN)
    counts = {v: sum(1 for x in verdicts if x.verdict == v) for v in kinds}
    total = f"{len(verdicts)} claim" + ("s" if len(verdicts) != 1 else "")
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {total})"
    if counts[NOT_REPRODUCED]:
        return NOT_REPRODUCED, summary
    if counts[REPRODUCED] == len(verdicts):
        return REPRODUCED, summary
    if counts[NOT_RUN] == len(verdicts):
        return NOT_RUN, summary
    return INCONCLUSIVE, summary
