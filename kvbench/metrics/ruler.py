"""RULER's scorers (NVIDIA/RULER scripts/eval/synthetic/constants.py and evaluate.py), also kvpress's.

  postprocess(pred)            strip, control characters to "\\n", strip again (RULER's postprocess_pred)
  match_all(pred, refs)        the fraction of the references found in the prediction (case-insensitive)
  match_part(pred, refs)       1.0 if any reference is found, else 0.0
  string_match_all(preds, refss) / string_match_part(...)   100 x the mean over samples, rounded to 2 decimals
Every task uses string_match_all except the QA tasks (qa_1, qa_2), which use string_match_part.
(lm-eval's `tasks/ruler` string_match_part averages the references found, like match_all; RULER's takes the max.)
"""
from __future__ import annotations

import re
from typing import Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    return _CONTROL.sub("\n", pred.strip()).strip()


def match_all(pred: str, refs: Sequence[str]) -> float:
    low = pred.lower()
    return sum(1.0 for r in refs if r.lower() in low) / len(refs)


def match_part(pred: str, refs: Sequence[str]) -> float:
    low = pred.lower()
    return max(1.0 if r.lower() in low else 0.0 for r in refs)


def metric_for(task: str):
    """The per-sample scorer of a RULER task: match_part for qa_*, match_all otherwise."""
    return match_part if task.startswith("qa") else match_all


def _mean_x100(values: Sequence[float]) -> float:
    return round(100 * sum(values) / len(values), 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    return _mean_x100([match_all(p, r) for p, r in zip(preds, refs)])


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    return _mean_x100([match_part(p, r) for p, r in zip(preds, refs)])
