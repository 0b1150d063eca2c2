"""Scorers of the reasoning tasks, as the field scores them.

GSM8K (lm-eval's `gsm8k` task, lm_eval/tasks/gsm8k/gsm8k.yaml): two extractions of the prediction, both reported
  strict    the first match of "#### (-?[0-9.,]+)"
  flexible  the last match of "(-?[$0-9.,]{2,})|(-?[0-9]+)" (its first non-empty group)
  ("[invalid]" when nothing matches), each compared by exact match after lm-eval's regexes_to_ignore ("," "$"
  "(?s).*#### " "\\.$", applied to prediction and reference) and ignore_case.
MATH-500 / AIME: math-verify (the field's checker for boxed answers): the gold answer parsed as LaTeX math, the
  prediction parsed with math-verify's default extraction (boxed answers first, then LaTeX and plain expressions),
  `verify(gold, prediction)` (symbolic equivalence: 1/2 = 0.5 = \\frac{1}{2}).
"""
from __future__ import annotations

import re
from typing import Optional

GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
GSM8K_IGNORE = (",", "\\$", "(?s).*#### ", "\\.$")
INVALID = "[invalid]"


def _regex_extract(pattern: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval's RegexFilter on one response."""
    found = pattern.findall(text if isinstance(text, str) else "")
    if not found:
        return INVALID
    match = found[group_select]
    if isinstance(match, tuple):
        parts = [m for m in match if m]
        match = parts[0] if parts else INVALID
    return match.strip()


def gsm8k_strict(text: str) -> str:
    return _regex_extract(GSM8K_STRICT, text, 0)


def gsm8k_flexible(text: str) -> str:
    return _regex_extract(GSM8K_FLEXIBLE, text, -1)


def _normalise(text: str) -> str:
    for pattern in GSM8K_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def gsm8k_exact_match(extracted: str, reference: str) -> float:
    """lm-eval's exact_match with gsm8k's settings (reference = the record's full answer, "... #### 72")."""
    return float(_normalise(extracted) == _normalise(reference))


def gsm8k_scores(prediction: str, reference: str) -> dict:
    """{'strict_match', 'flexible_extract'} (0/1) and the two extracted answers."""
    strict, flexible = gsm8k_strict(prediction), gsm8k_flexible(prediction)
    return {"strict_match": gsm8k_exact_match(strict, reference),
            "flexible_extract": gsm8k_exact_match(flexible, reference),
            "extracted_strict": strict, "extracted_flexible": flexible}


def _math_verify():
    try:
        import math_verify
    except ImportError as exc:  # pragma: no cover - declared dependency
        raise RuntimeError("math500 / aime scoring needs math-verify: pip install 'math-verify[antlr4_9_3]'") from exc
    return math_verify


def parse_gold(answer: str) -> list:
    """The gold answer (MATH-500 / AIME `answer`, LaTeX without $) as math-verify parses it."""
    mv = _math_verify()
    text = str(answer).strip()
    if not (text.startswith("$") or text.startswith("\\boxed") or text.startswith("\\(")):
        text = f"${text}$"
    return mv.parse(text)


def math_verify_score(prediction: str, answer: str) -> dict:
    """{'correct': 0/1, 'extracted': what math-verify read from the prediction (None when nothing)}."""
    mv = _math_verify()
    gold = parse_gold(answer)
    pred = mv.parse(prediction or "")
    correct = bool(gold) and bool(pred) and bool(mv.verify(gold, pred))
    extracted: Optional[str] = str(pred[-1]) if pred else None
    return {"correct": float(correct), "extracted": extracted}
