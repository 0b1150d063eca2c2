"""LongBench v1 scorers, re-implemented from the definitions in THUDM/LongBench (`metrics.py`, `eval.py`).

Every scorer takes ``(prediction, ground_truth, **kwargs)`` and returns a float in [0, 1], as the official ones do;
`score_sample` takes the max over the references, `score_dataset` reports 100 x mean with 2 decimals.
Optional dependencies (jieba, rouge, fuzzywuzzy) are imported inside the functions that need them.
"""

from __future__ import annotations

import logging
import math
import re
import string
import warnings
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

Scorer = Callable[..., float]

# Chinese and full-width punctuation removed by the official normalize_zh_answer (in addition to ASCII punctuation).
CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = frozenset(string.punctuation + CN_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")

# Datasets whose prediction is cut to its first line before scoring (few-shot tasks, eval.py).
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})


# --------------------------------------------------------------------------- normalisation
def normalize_answer(s: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace (SQuAD style)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _EN_PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation, remove all whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _ZH_PUNCT)
    return "".join(s.split())


def _jieba_cut(text: str) -> list[str]:
    import jieba  # lazy: slow to initialise

    jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict ..." on first use
    return list(jieba.cut(text, cut_all=False))


# --------------------------------------------------------------------------- token F1
def f1_score(prediction: Sequence[str], ground_truth: Sequence[str], **kwargs: Any) -> float:
    """Bag-of-tokens F1 between two token lists (0 when they share no token)."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 after `normalize_answer`, whitespace tokens (English QA)."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Token F1 over jieba tokens, each normalised with `normalize_zh_answer`, empty tokens dropped (Chinese QA)."""

    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(tok) for tok in _jieba_cut(text)) if t]

    return f1_score(tokens(prediction), tokens(ground_truth))


# --------------------------------------------------------------------------- ROUGE-L (the `rouge` package)
def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of the `rouge` package (`Rouge().get_scores([pred], [ref], avg=True)`); 0.0 if it raises.

    The package raises for an empty hypothesis or reference (also one made only of punctuation), and the official
    code maps every exception to 0.
    """
    from rouge import Rouge  # lazy

    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # noqa: BLE001 - the official scorer swallows every error
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """`rouge_score` on jieba tokens joined by single spaces (Chinese summarisation / QA)."""
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


# --------------------------------------------------------------------------- classification / retrieval / count
def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Class-name matching used for trec and lsht; needs ``all_classes``.

    Matches are the class names found as substrings of the prediction. Matches that are a strict substring of the
    ground truth are then removed, reproducing the official loop that calls ``list.remove`` while iterating over the
    same list (so the element right after each removed one is not examined). Score = 1 / #matches if the ground truth
    is among the remaining matches, else 0. The official difflib fallback is unreachable (its guard
    ``em_match_list != 0`` is always true), so an empty match list scores 0, as it does officially.
    """
    all_classes = kwargs.get("all_classes")
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (the dataset's class names)")
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):  # the semantics of `for term in matches: ... matches.remove(term)`
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _id_fraction(prediction: str, target: str) -> float:
    """Fraction of the integers in the prediction that equal ``target`` (0 when there is none)."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(1 for n in numbers if n == target) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_en: the id in the reference ``Paragraph N``; share of the prediction's numbers equal to N."""
    target = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    return _id_fraction(prediction, target)


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_retrieval_zh: as `retrieval_score` with the reference pattern ``段落N``."""
    target = re.findall(r"段落(\d+)", ground_truth)[0]
    return _id_fraction(prediction, target)


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """passage_count: share of the integers in the prediction equal to the reference count."""
    return _id_fraction(prediction, str(ground_truth))


# --------------------------------------------------------------------------- code
def first_code_line(prediction: str) -> str:
    """First line (after leading newlines) that contains none of '`', '#', '//'; '' if there is none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """fuzzywuzzy ``fuzz.ratio`` / 100 between the first non-comment line of the prediction and the reference.

    Without python-Levenshtein fuzzywuzzy uses difflib (the setup of the official requirements); with it installed
    the ratios can differ slightly.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Using slow pure-python SequenceMatcher"
        from fuzzywuzzy import fuzz  # lazy

    return fuzz.ratio(first_code_line(prediction), ground_truth) / 100


# --------------------------------------------------------------------------- dataset level
dataset2metric: dict[str, Scorer] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}


def _base(dataset: str) -> str:
    """Map a LongBench-E name ``<name>_e`` to ``<name>`` and check that the dataset has a metric."""
    name = dataset[:-2] if dataset.endswith("_e") and dataset[:-2] in dataset2metric else dataset
    if name not in dataset2metric:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; valid: {sorted(dataset2metric)}")
    return name


def metric_for(dataset: str) -> Scorer:
    """The official scorer of a dataset (accepts LongBench-E names ``<name>_e``)."""
    return dataset2metric[_base(dataset)]


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """Score one prediction in [0, 1]: first line only for trec/triviaqa/samsum/lsht, max over the references."""
    name = _base(dataset)
    if isinstance(answers, str):
        answers = [answers]
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    scorer = dataset2metric[name]
    score = 0.0
    for ground_truth in answers:
        score = max(score, scorer(prediction, ground_truth, all_classes=all_classes))
    return float(score)


def _per_sample(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None,
) -> list[float]:
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    return [score_sample(dataset, p, a, all_classes) for p, a in zip(predictions, answers)]


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Official dataset score: 100 x mean of `score_sample`, rounded to 2 decimals."""
    scores = _per_sample(dataset, predictions, answers, all_classes)
    if not scores:
        raise ValueError(f"no predictions to score for {dataset!r}")
    return round(100 * sum(scores) / len(scores), 2)


LENGTH_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def length_bucket(length: int) -> str:
    """LongBench-E bucket of a sample's ``length`` field: <4000, <8000, else."""
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


def score_longbench_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Iterable[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """LongBench-E: 100 x mean per length bucket (0-4k, 4-8k, 8k+), 2 decimals; NaN for an empty bucket."""
    lengths = list(lengths)
    scores = _per_sample(dataset, predictions, answers, all_classes)
    if len(lengths) != len(scores):
        raise ValueError(f"{len(scores)} predictions but {len(lengths)} lengths")
    buckets: dict[str, list[float]] = {key: [] for key in LENGTH_BUCKETS}
    for score, length in zip(scores, lengths):
        buckets[length_bucket(length)].append(score)
    return {
        key: round(100 * sum(vals) / len(vals), 2) if vals else math.nan for key, vals in buckets.items()
    }
