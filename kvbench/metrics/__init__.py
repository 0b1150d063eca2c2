"""Task metrics: the official LongBench v1 scorers, ROUGE (official `rouge` package and Google rouge-score) and a
repetition check for degenerate generations."""

from kvbench.metrics.longbench import (
    FIRST_LINE_DATASETS,
    LENGTH_BUCKETS,
    classification_score,
    code_sim_score,
    count_score,
    dataset2metric,
    length_bucket,
    metric_for,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
    score_dataset,
    score_longbench_e,
    score_sample,
)
from kvbench.metrics.repetition import is_degenerate, repetition_share
from kvbench.metrics.rouge import mean_scores, rouge_l_official, rouge_score_f, summarization_scores

__all__ = [
    "FIRST_LINE_DATASETS",
    "LENGTH_BUCKETS",
    "classification_score",
    "code_sim_score",
    "count_score",
    "dataset2metric",
    "is_degenerate",
    "length_bucket",
    "mean_scores",
    "metric_for",
    "normalize_answer",
    "normalize_zh_answer",
    "qa_f1_score",
    "qa_f1_zh_score",
    "repetition_share",
    "retrieval_score",
    "retrieval_zh_score",
    "rouge_l_official",
    "rouge_score",
    "rouge_score_f",
    "rouge_zh_score",
    "score_dataset",
    "score_longbench_e",
    "score_sample",
    "summarization_scores",
]
