"""SCBench's scoring (microsoft/MInference scbench/compute_scores.py) for the string-retrieval tasks, per turn.

    kv_retrieval(pred, label)       scbench_kv, scbench_prefix_suffix (and hashhop, so scbench_multi_hop): the
                                    label is a substring of the prediction (get_score_one_kv_retrieval)
    string_match_all(pred, refs)    scbench_vt: the share of references found in the prediction, case-insensitive,
                                    rounded to 2 digits (string_match_all)
Tasks read from the hub whose scorer is not here (repoqa's pass@1, summaries' ROUGE, the Chinese QA F1) are refused
by the task before the model loads.
"""
from __future__ import annotations

from typing import Union


def kv_retrieval(pred: str, label: Union[str, list]) -> float:
    """1.0 when the label is in the prediction (a list label: its first element, as SCBench's labels are)."""
    if isinstance(label, list):
        label = label[0]
    return float(label in pred)


def string_match_all(pred: str, refs: Union[str, list]) -> float:
    refs = [refs] if isinstance(refs, str) else list(refs)
    return round(sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs), 2)


SCORERS = {"scbench_kv": kv_retrieval, "scbench_prefix_suffix": kv_retrieval, "scbench_multi_hop": kv_retrieval,
           "scbench_vt": string_match_all}


def score_one(task: str, pred: str, label: Union[str, list]) -> float:
    return SCORERS[task](pred, label)
