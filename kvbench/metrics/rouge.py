"""ROUGE for summarisation: the official LongBench ROUGE-L (`rouge` package) beside Google's `rouge-score`.

The two packages tokenise differently and give different numbers on the same pair; LongBench reports the first
(`rouge_l`), papers using rouge-score report R-1/R-2/R-L/R-Lsum (`rouge1`, `rouge2`, `rougeL`, `rougeLsum`).
All values are F-measures in [0, 1], each the max over the references (taken per key).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from kvbench.metrics.longbench import rouge_score as _official_rouge_l

ROUGE_SCORE_KEYS: tuple[str, ...] = ("rouge1", "rouge2", "rougeL", "rougeLsum")


@lru_cache(maxsize=4)
def _scorer(use_stemmer: bool) -> Any:
    from rouge_score import rouge_scorer  # lazy

    return rouge_scorer.RougeScorer(list(ROUGE_SCORE_KEYS), use_stemmer=use_stemmer)


def _as_list(references: str | Sequence[str]) -> list[str]:
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("need at least one reference")
    return refs


def rouge_l_official(prediction: str, references: str | Sequence[str]) -> float:
    """LongBench's ROUGE-L F (`rouge` package, 0 on its errors), max over the references."""
    return max(_official_rouge_l(prediction, ref) for ref in _as_list(references))


def rouge_score_f(
    prediction: str, references: str | Sequence[str], use_stemmer: bool = True
) -> dict[str, float]:
    """Google rouge-score F-measures ``rouge1/rouge2/rougeL/rougeLsum``, per-key max over the references.

    rouge-score's ``score(target, prediction)`` takes the reference first. ``rougeLsum`` splits sentences on
    newlines only (no sentence splitter is applied). Porter stemming is on by default, as in the usual
    summarisation setups (transformers' run_summarization).
    """
    scorer = _scorer(use_stemmer)
    best = {key: 0.0 for key in ROUGE_SCORE_KEYS}
    for ref in _as_list(references):
        scores = scorer.score(ref, prediction)
        for key in ROUGE_SCORE_KEYS:
            best[key] = max(best[key], float(scores[key].fmeasure))
    return best


def summarization_scores(
    prediction: str, references: str | Sequence[str], use_stemmer: bool = True
) -> dict[str, float]:
    """All ROUGE numbers of one sample: ``rouge_l`` (official `rouge` package) plus the rouge-score F-measures."""
    return {"rouge_l": rouge_l_official(prediction, references), **rouge_score_f(prediction, references, use_stemmer)}


def mean_scores(samples: Iterable[Mapping[str, float]], scale: float = 100.0, ndigits: int = 2) -> dict[str, float]:
    """Mean of each key over per-sample score dicts, times ``scale``, rounded (the LongBench reporting)."""
    rows = list(samples)
    if not rows:
        raise ValueError("no samples to average")
    keys = rows[0].keys()
    return {key: round(scale * sum(row[key] for row in rows) / len(rows), ndigits) for key in keys}
