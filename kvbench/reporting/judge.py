"""The verdict on one score of a paired run: pass, regression or inconclusive, from the interval of its change.

    judge_score(name, base_samples, new_samples, b, n, min_effect, rel_tol, max_drop, samples_lost) -> Judgement

A judge that knows its noise: the change NEW - BASE is read as an interval (a paired bootstrap 95% interval over
the items both runs scored, else BASE's own interval around the change, widened to at least --rel-tol x |base|:
float noise), in the direction that is worse ("worse" > 0 is a regression direction), and set against the smallest
change worth flagging, `min_effect` (relative to BASE: 0.01 = 1% of the metric; --max-drop, in the metric's unit,
raises it):

- regression: the interval excludes no change (its low end above 0) and the change is at least `min_effect`;
- ok (better when the whole interval is an improvement): the interval's worse end is below `min_effect` (or at
  most 0): the data rule out a change the user cares about;
- inconclusive: anything else: the interval holds both no change and a change of `min_effect` (a short run, 4
  perplexity windows, a change confined to one window), or a resolved change that may or may not reach it. The
  gate never prints PASS then.

Perplexity and its NLL are judged on one scale, the NLL (log perplexity): the interval is the NLL's, min_effect is
log(1 + min_effect) (a relative change of perplexity), the noise floor log(1 + rel_tol), and --max-drop is in
perplexity units; so `ppl` and `nll` of one run always get the same verdict.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from kvbench.reporting import stats

LOG_SCALE = ("ppl", "nll")  # judged as NLL (log perplexity)


@dataclass
class Judgement:
    verdict: str  # regression | inconclusive | ok | better
    change_lo: float  # 95% interval of NEW - BASE, in the metric's unit
    change_hi: float
    min_effect: float  # the smallest change worth flagging, in the metric's unit (a change for the worse)
    tolerance: float  # half the interval's width, in the metric's unit
    source: str  # where the interval comes from


def _verdict(lo: float, hi: float, worse: float, effect: float) -> str:
    """lo..hi: the interval of the change in the worse direction; effect: the min effect on that scale."""
    if lo > 0 and worse >= effect:
        return "regression"
    if hi < 0:
        return "better"
    if hi < effect or hi <= 0:
        return "ok"
    return "inconclusive"


def _log_scale(name: str, b: float, n: float) -> bool:
    return name in LOG_SCALE and (name == "nll" or (b > 0 and n > 0))


def judge_score(name: str, base_samples: Optional[Sequence[dict]], new_samples: Optional[Sequence[dict]],
                b: float, n: float, *, min_effect: float, rel_tol: float, max_drop: float,
                samples_lost: bool = False) -> Judgement:
    """The verdict on a score (see the module docstring). samples_lost: NEW lost samples BASE has, so no bootstrap
    interval is used (never a wider one): the noise floor only."""
    log = _log_scale(name, b, n)
    lower_better = stats.lower_is_better(name)
    if log:
        bx, nx = (math.log(b), math.log(n)) if name == "ppl" else (b, n)
        ppl_b = b if name == "ppl" else math.exp(min(b, 700.0))
        effect = math.log1p(min_effect)
        if max_drop > 0:
            effect = max(effect, math.log1p(max_drop / ppl_b) if ppl_b > 0 else math.inf)
        floors = [(math.log1p(rel_tol), f"relative {rel_tol:g}")]
        worse, stat_name = nx - bx, "nll"
    else:
        bx, nx = b, n
        effect = max(min_effect * abs(b), max_drop)
        floors = [(rel_tol * abs(b), f"relative {rel_tol:g}")]
        worse, stat_name = ((n - b) if lower_better else (b - n)), name
    floor, source = max(floors, key=lambda f: f[0])
    lo, hi = worse - floor, worse + floor
    if samples_lost:
        source += " (samples missing in NEW)"
    elif base_samples:
        unit = stats.sample_unit(stat_name, base_samples)
        paired = stats.paired_interval(stat_name, base_samples, new_samples or [], None if log else b,
                                       None if log else n)
        if paired is not None:
            d_lo, d_hi, count = paired  # of NEW - BASE
            w_lo, w_hi = (d_lo, d_hi) if (log or lower_better) else (-d_hi, -d_lo)
            lo, hi = min(lo, w_lo), max(hi, w_hi)  # the union of the bootstrap's interval and the noise floor's
            source = f"paired bootstrap 95% over {count} {unit}"
        else:
            fn = stats.statistic(stat_name, base_samples, None if log else b)
            count = stats.sample_count(stat_name, base_samples)
            if fn is not None and count >= 2:
                b_lo, b_hi = stats.bootstrap_interval(fn, count)
                centre = fn(np.arange(count))
                width = max((b_hi - centre) if (log or lower_better) else (centre - b_lo), 0.0)
                if width > floor:
                    lo, hi = worse - width, worse + width
                    source = f"bootstrap 95% of BASE over {count} {unit}"
    verdict = _verdict(lo, hi, worse, effect)
    # back to the metric's unit, as NEW - BASE
    if log and name == "ppl":
        c_lo, c_hi, eff = b * math.expm1(lo), b * math.expm1(hi), b * math.expm1(effect)
    elif log or lower_better:
        c_lo, c_hi, eff = lo, hi, effect
    else:
        c_lo, c_hi, eff = -hi, -lo, effect
    return Judgement(verdict, c_lo, c_hi, eff, (c_hi - c_lo) / 2.0, source)


SEVERITY = {"regression": 3, "inconclusive": 2, "ok": 1, "better": 0}


def one_verdict(rows: list[dict], metrics: Sequence[str] = LOG_SCALE) -> None:
    """Give the rows of `metrics` (ppl and nll of one run) the most severe verdict among them, in place: one run's
    perplexity and NLL never disagree (rounding of a recorded figure could otherwise split a borderline case)."""
    judged = [r for r in rows if r["metric"] in metrics and r["kind"] == "score" and r["verdict"] in SEVERITY]
    if len(judged) < 2:
        return
    worst = max(judged, key=lambda r: SEVERITY[r["verdict"]])
    for r in judged:
        if r["verdict"] != worst["verdict"]:
            r["note"] = (r["note"] + "; " if r["note"] else "") + f"verdict of {worst['metric']} (one scale)"
            r["verdict"] = worst["verdict"]
