"""SCBench's scoring (microsoft/MInference scbench/compute_scores.py, repo_qa_utils.py), one turn at a time.

compute_scores maps each SCBench task to InfiniteBench's scorer (Multiturnbench_to_Infinitebench) or its own:
    kv_retrieval(pred, label)        scbench_kv, scbench_prefix_suffix, hashhop (so scbench_multi_hop): the label
                                     is a substring of the prediction (get_score_one_kv_retrieval)
    string_match_all(pred, refs)     scbench_vt: the share of references in the prediction, case-insensitive,
                                     rounded to 2 digits
    dialogue_match(pred, refs)       scbench_qa_eng (-> longdialogue_qa_eng) and scbench_many_shot: 1 when a
                                     reference (upper-cased) is in the stripped, upper-cased prediction
    choice(pred, [answer, letter])   scbench_choice_eng (-> longbook_choice_eng): the first letter, the whole
                                     prediction, the text after an "answer is" prefix, or the first A-D word
    qa_f1_zh(pred, refs)             scbench_qa_chn (-> longbook_qa_chn): character F1 after removing Chinese and
                                     ASCII punctuation and whitespace, max over the references
    math_find(pred, label)           scbench_mf (-> math_find): the first number in the prediction equals the label
                                     (int: compared as int(float(number)))
    summary_rouge(pred, ref)         scbench_summary: ROUGE-Lsum F of `evaluate.load("rouge")`, which is Google's
                                     rouge-score without stemming (computed here with rouge-score directly, so no
                                     download is needed; the same numbers)
    passkey(pred, label)             the passkey turns of scbench_summary_with_needles: the first integer in the
                                     prediction equals the label
    repoqa(pred, name, needles, ...) scbench_repoqa and the repoqa turns of scbench_repoqa_and_kv: pass@1 at
                                     similarity threshold 0.8 with one sample, i.e. 1 when the function most
                                     similar (BLEU, nltk method4 smoothing, on whitespace tokens) to the
                                     prediction's code among the repository's needles is the asked one and its
                                     similarity is >= 0.8
Departures (docs/configuration.md#scbench): repoqa's sanitize_output extracts the first function of the first code
block with tree-sitter; kvbench takes the first code block whole (sanitize_output's own fallback when tree-sitter
finds no function), as tree-sitter's grammars are not a dependency. A reference given as one text where SCBench's
scorer iterates a list (qa_chn, many_shot) is taken as a one-item list (SCBench would iterate its characters).
"""
from __future__ import annotations

import re
import string
from collections import Counter
from functools import lru_cache
from typing import Any, Union

Label = Union[str, list, int, float]


def _refs(label: Label) -> list:
    return list(label) if isinstance(label, list) else [label]


def kv_retrieval(pred: str, label: Label) -> float:
    """1.0 when the label is in the prediction (a list label: its first element, as SCBench's labels are)."""
    if isinstance(label, list):
        label = label[0]
    return float(label in pred)


def string_match_all(pred: str, refs: Label) -> float:
    refs = _refs(refs)
    return round(sum(1.0 if r.lower() in pred.lower() else 0.0 for r in refs) / len(refs), 2)


def dialogue_match(pred: str, refs: Label) -> float:
    """get_score_one_longdialogue_qa_eng."""
    pred = pred.strip().upper()
    return float(any(r.upper() in pred for r in _refs(refs)))


def choice(pred: str, label: list) -> float:
    """get_score_one_longbook_choice_eng; label = [answer text, its letter] (get_ground_truth)."""
    pred = pred.strip()
    if pred == "":
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in label)
    if pred in label:
        return 1.0
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return 0.0
        after = pred[idx + len(prefix) + 1:]
        return float(any(after.startswith(s) for s in label))
    for word in pred.split():
        if word in "ABCD":  # SCBench's test: a substring of "ABCD" (so "AB" counts too)
            return float(word in label)
    return 0.0


_CN_PUNCT = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—"
             "‘’‛“”„‟…‧﹏.")
_ALL_PUNCT = set(string.punctuation + _CN_PUNCT)


def _normalize_zh(s: str) -> str:
    return "".join("".join(ch for ch in s.lower() if ch not in _ALL_PUNCT).split())


def _f1(pred: list, truth: list) -> float:
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(truth)
    return 2 * p * r / (p + r)


def qa_f1_zh(pred: str, refs: Label) -> float:
    """qa_f1_score_zh: one character one token."""
    return max(_f1(list(_normalize_zh(pred)), list(_normalize_zh(r))) for r in _refs(refs))


def math_find(pred: str, label: Label) -> float:
    """get_score_one_math_find (label an int or a float; a list: its first element)."""
    if isinstance(label, list):
        label = label[0]
    first = re.search(r"\d+\.\d+|\d+", pred)
    if first is None:
        return 0.0
    number = first.group(0).strip()
    if isinstance(label, int):
        return float(int(float(number)) == label)
    return float(float(number) == label)


@lru_cache(maxsize=1)
def _rouge_lsum() -> Any:
    from rouge_score import rouge_scorer  # lazily

    # evaluate's "rouge" metric: RougeScorer(rouge_types, use_stemmer=False), score(reference, prediction)
    return rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)


def summary_rouge(pred: str, ref: Label) -> float:
    """get_score_one_longbook_sum_eng: ROUGE-Lsum F-measure of one prediction against its reference."""
    if isinstance(ref, list):  # evaluate's rouge with a list of references: score_multi, the best one
        return max(float(_rouge_lsum().score(r, pred)["rougeLsum"].fmeasure) for r in ref)
    return float(_rouge_lsum().score(ref, pred)["rougeLsum"].fmeasure)


def _first_int(pred: str) -> str:
    return next((item for item in re.split("[^0-9]", pred) if item != ""), "")


def passkey(pred: str, label: Label) -> float:
    """get_score_one_passkey: the label equals the prediction's first run of digits."""
    if isinstance(label, list):
        label = label[0]
    return float(label == _first_int(pred))


# --------------------------------------------------------------------------- repoqa (repo_qa_utils)
REPOQA_THRESHOLD = 0.8  # compute_scores reports scores["all"][0.8]["pass@1"]
_CODE_BLOCK = re.compile(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", re.DOTALL | re.MULTILINE)


def sanitize_output(model_output: str) -> str:
    """The first code block of the output (the whole output when it has none)."""
    model_output = model_output.strip()
    blocks = _CODE_BLOCK.findall(model_output)
    return blocks[0] if blocks else model_output


def function_similarity(candidate: str, reference: str) -> float:
    """compute_function_similarity: sentence BLEU on whitespace tokens, Chen & Cherry's method4 smoothing."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu  # lazily

    cand = re.split(r"\s+", candidate.strip())
    ref = re.split(r"\s+", reference.strip())
    return float(sentence_bleu([ref], cand, smoothing_function=SmoothingFunction().method4))


def repoqa(pred: str, name: str, needles: list[dict]) -> float:
    """needle_evaluator + pass@1 at 0.8 for one output: `needles` are the repository's [{name, needle}]."""
    out = sanitize_output(pred)
    best_name, best = None, 0.0
    for needle in needles:
        sim = function_similarity(out, needle["needle"])
        if sim > best:
            best, best_name = sim, needle["name"]
    return float(best_name == name and best >= REPOQA_THRESHOLD)


SCORERS = {"scbench_kv": kv_retrieval, "scbench_prefix_suffix": kv_retrieval, "scbench_multi_hop": kv_retrieval,
           "scbench_vt": string_match_all, "scbench_qa_eng": dialogue_match, "scbench_many_shot": dialogue_match,
           "scbench_choice_eng": choice, "scbench_qa_chn": qa_f1_zh, "scbench_mf": math_find,
           "scbench_summary": summary_rouge, "scbench_passkey": passkey}
# the tasks whose turns each name their own subtask ("task" per turn)
MIXED = {"scbench_summary_with_needles": ("scbench_summary", "scbench_passkey"),
         "scbench_repoqa_and_kv": ("scbench_repoqa", "scbench_kv")}


def score_one(task: str, pred: str, label: Label) -> float:
    """A turn of a task scored by a label alone (every task but repoqa's, which needs the repository's needles)."""
    return SCORERS[task](pred, label)
