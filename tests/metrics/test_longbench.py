"""LongBench v1 scorers and ROUGE, with fixtures worked out from the official definitions."""

import math

import pytest

from kvbench.data.longbench import LONGBENCH_DATASETS
from kvbench.metrics import longbench as lb
from kvbench.metrics.rouge import mean_scores, rouge_l_official, rouge_score_f, summarization_scores


# --------------------------------------------------------------------------- normalisation and QA F1
def test_normalize_answer_drops_punctuation_articles_and_case():
    assert lb.normalize_answer("The Cat, sat!  on a mat.") == "cat sat on mat"
    assert lb.normalize_answer("An apple") == "apple"
    assert lb.normalize_answer("theatre") == "theatre"  # articles only as whole words


def test_normalize_zh_answer_drops_chinese_punctuation_and_spaces():
    assert lb.normalize_zh_answer("北京， 是 首都！") == "北京是首都"
    assert lb.normalize_zh_answer("ABC。") == "abc"


def test_qa_f1_token_overlap():
    # pred tokens [cat, sat, on, mat], reference [cat, on, mat]: P = 3/4, R = 1
    assert lb.qa_f1_score("The cat sat on the mat", "a cat on a mat") == pytest.approx(2 * 0.75 / 1.75)
    assert lb.qa_f1_score("Paris", "paris.") == 1.0
    assert lb.qa_f1_score("Berlin", "Paris") == 0.0
    assert lb.qa_f1_score("", "Paris") == 0.0


def test_qa_f1_zh_uses_jieba_words_not_characters():
    # jieba: 北京 是 中国 的 首都 。 -> punctuation token dropped -> 5 tokens, 1 shared: P = 1/5, R = 1
    assert lb.qa_f1_zh_score("北京是中国的首都。", "北京") == pytest.approx(1 / 3)
    # 北京大学 is one jieba word, so it shares no token with 北京 (a character F1 would give 2/3)
    assert lb.qa_f1_zh_score("北京大学", "北京") == 0.0
    assert lb.qa_f1_zh_score("北京。", "北京") == 1.0


# --------------------------------------------------------------------------- ROUGE
def test_rouge_official_and_rouge_score_differ_on_the_same_pair():
    pred, ref = "the cat sat on the mat today", "a cat was sitting on the mat"
    # `rouge` package: n-gram sets, 4 of 6 hypothesis and 4 of 7 reference words -> F = 8/13
    assert lb.rouge_score(pred, ref) == pytest.approx(8 / 13, abs=1e-6)
    # rouge-score: LCS cat-on-the-mat, 4 of 7 tokens on both sides -> F = 4/7
    rs = rouge_score_f(pred, [ref])
    assert rs["rougeL"] == pytest.approx(4 / 7)
    assert rs["rouge1"] == pytest.approx(4 / 7)
    assert abs(lb.rouge_score(pred, ref) - rs["rougeL"]) > 0.04


def test_rouge_official_returns_zero_on_package_errors():
    assert lb.rouge_score("", "a reference") == 0.0  # "Hypothesis is empty."
    assert lb.rouge_score("...", "a reference") == 0.0


def test_rouge_zh_tokenizes_with_jieba():
    # unsegmented Chinese is one "word" for the rouge package: different strings -> 0
    assert lb.rouge_score("今天天气很好", "今天天气不好") == 0.0
    # jieba: [今天天气, 很, 好] vs [今天天气, 不好] -> LCS 1: P = 1/3, R = 1/2, F = 0.4
    assert lb.rouge_zh_score("今天天气很好", "今天天气不好") == pytest.approx(0.4, abs=1e-6)
    assert lb.rouge_zh_score("今天天气很好", "今天天气很好") == pytest.approx(1.0, abs=1e-6)


def test_rouge_score_max_over_references_and_stemming():
    pred = "the cats are running"
    refs = ["completely unrelated words here", "the cats are running"]
    assert rouge_score_f(pred, refs) == {k: pytest.approx(1.0) for k in ("rouge1", "rouge2", "rougeL", "rougeLsum")}
    assert rouge_score_f("running cats", "run cat")["rouge1"] == pytest.approx(1.0)
    assert rouge_score_f("running cats", "run cat", use_stemmer=False)["rouge1"] == 0.0
    assert rouge_l_official(pred, refs) == pytest.approx(1.0, abs=1e-6)


def test_summarization_scores_and_mean():
    s = summarization_scores("the cat sat on the mat today", ["a cat was sitting on the mat"])
    assert set(s) == {"rouge_l", "rouge1", "rouge2", "rougeL", "rougeLsum"}
    assert s["rouge_l"] == pytest.approx(8 / 13, abs=1e-6)
    assert mean_scores([{"a": 0.5, "b": 1.0}, {"a": 0.25, "b": 0.0}]) == {"a": 37.5, "b": 50.0}
    with pytest.raises(ValueError):
        rouge_score_f("x", [])


# --------------------------------------------------------------------------- classification
def test_classification_strict_substring_of_truth_is_removed():
    classes = ["location", "other location", "city"]
    # matches [location, other location]; "location" is inside the truth and not equal -> dropped -> 1/1
    assert lb.classification_score("Type: other location", "other location", all_classes=classes) == 1.0
    # two matches, neither inside the truth -> 1/2
    assert lb.classification_score("location or city", "city", all_classes=classes) == 0.5
    assert lb.classification_score("no idea", "city", all_classes=classes) == 0.0  # no difflib fallback


def test_classification_reproduces_remove_while_iterating():
    # matches [ab, bc, abc]: removing "ab" shifts "bc" into the examined slot, so "bc" is never checked and stays
    assert lb.classification_score("abc", "abc", all_classes=["ab", "bc", "abc"]) == 0.5


def test_classification_needs_all_classes():
    with pytest.raises(ValueError, match="all_classes"):
        lb.classification_score("city", "city")


# --------------------------------------------------------------------------- retrieval / count
def test_retrieval_parses_paragraph_id():
    assert lb.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert lb.retrieval_score("Paragraph 3 or Paragraph 30", "Paragraph 3") == 0.5
    assert lb.retrieval_score("Paragraph 4", "Paragraph 3") == 0.0
    assert lb.retrieval_score("I do not know", "Paragraph 3") == 0.0


def test_retrieval_zh_parses_duanluo_id():
    assert lb.retrieval_zh_score("答案是段落12", "段落12") == 1.0
    assert lb.retrieval_zh_score("段落1，段落12", "段落12") == 0.5
    assert lb.retrieval_zh_score("段落2", "段落12") == 0.0


def test_count_score_share_of_matching_numbers():
    assert lb.count_score("12", "12") == 1.0
    assert lb.count_score("There are 12 unique paragraphs, not 13", "12") == 0.5
    assert lb.count_score("none", "12") == 0.0


# --------------------------------------------------------------------------- code
def test_code_first_line_skips_comments_and_fences():
    assert lb.first_code_line("\n\n# comment\n// other\n```python\nx = 1\ny = 2") == "x = 1"
    assert lb.first_code_line("x = 1  # trailing comment\ny = 2") == "y = 2"
    assert lb.first_code_line("# only\n// comments") == ""
    assert lb.code_sim_score("```\nreturn a + b\n```", "return a + b") == 1.0
    assert lb.code_sim_score("abc", "abd") == pytest.approx(0.67)


# --------------------------------------------------------------------------- dataset level
def test_every_dataset_has_its_metric():
    assert set(lb.dataset2metric) == set(LONGBENCH_DATASETS)
    expected = {
        "narrativeqa": lb.qa_f1_score, "triviaqa": lb.qa_f1_score, "multifieldqa_zh": lb.qa_f1_zh_score,
        "gov_report": lb.rouge_score, "samsum": lb.rouge_score, "dureader": lb.rouge_zh_score,
        "vcsum": lb.rouge_zh_score, "trec": lb.classification_score, "lsht": lb.classification_score,
        "passage_retrieval_en": lb.retrieval_score, "passage_retrieval_zh": lb.retrieval_zh_score,
        "passage_count": lb.count_score, "lcc": lb.code_sim_score, "repobench-p": lb.code_sim_score,
    }  # fmt: skip
    for name, fn in expected.items():
        assert lb.dataset2metric[name] is fn, name
    assert lb.metric_for("qasper_e") is lb.qa_f1_score


def test_score_sample_max_over_references():
    assert lb.score_sample("hotpotqa", "Paris", ["London", "paris"]) == 1.0
    assert lb.score_sample("hotpotqa", "Paris", ["London"]) == 0.0
    assert lb.score_sample("hotpotqa", "Paris", "Paris") == 1.0  # a bare string is one reference


def test_score_sample_first_line_rule():
    pred = "\nParis\nLondon is wrong"
    assert lb.score_sample("triviaqa", pred, ["Paris"]) == 1.0
    # hotpotqa scores the whole text: [paris, london, is, wrong] vs [paris] -> F1 0.4
    assert lb.score_sample("hotpotqa", pred, ["Paris"]) == pytest.approx(0.4)
    classes = ["体育", "财经", "娱乐"]
    assert lb.score_sample("lsht", "体育\n财经", ["体育"], all_classes=classes) == 1.0
    assert lb.classification_score("体育\n财经", "体育", all_classes=classes) == 0.5


def test_score_dataset_100x_mean_two_decimals():
    preds = ["Paris", "Berlin", "Paris"]
    answers = [["Paris"], ["Paris"], ["London"]]
    assert lb.score_dataset("hotpotqa", preds, answers) == 33.33
    with pytest.raises(ValueError):
        lb.score_dataset("hotpotqa", [], [])
    with pytest.raises(ValueError):
        lb.score_dataset("hotpotqa", ["a"], [["a"], ["b"]])


def test_score_longbench_e_buckets():
    preds = ["x", "x", "y", "x", "x"]  # ("a" would be dropped as an article)
    answers = [["x"]] * 5
    lengths = [100, 3999, 4000, 7999, 8000]
    assert lb.score_longbench_e("hotpotqa_e", preds, answers, lengths) == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 100.0}
    out = lb.score_longbench_e("hotpotqa", ["x"], [["x"]], [10])
    assert out["0-4k"] == 100.0 and math.isnan(out["8k+"])


def test_unknown_dataset_is_rejected():
    with pytest.raises(ValueError, match="nope"):
        lb.score_sample("nope", "a", ["a"])
