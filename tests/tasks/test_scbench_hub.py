"""task=scbench on SCBench's hub tasks beyond string retrieval: a hand-written row per task in the hub's format loads,
each turn's prompt is SCBench's (eval_utils' templates, transcribed here as literal text), a known prediction
scores as SCBench's scorer scores it (compute_scores.py / repo_qa_utils.py, their behaviour worked by hand), and a
run through the app on a tiny folder writes per-turn scores."""
from __future__ import annotations

import json

import pytest

from kvbench.data import scbench as sd
from kvbench.errors import UserError
from kvbench.metrics import scbench as sm
from kvbench.tasks import build_task
from kvbench.tasks import scbench as st
from tests.fixtures.task_fixtures import one_thread, run_cfg, smollm2_tokenizer, tiny_loader, write_jsonl

single_thread = pytest.fixture(one_thread)

FOO = "def foo(a, b):\n    total = a + b\n    return total * 2"
BAR = "def bar(items):\n    out = []\n    for x in items:\n        out.append(x)\n    return out"
ROWS = {
    "scbench_choice_eng": {"id": 0, "context": "BOOK", "multi_turns": [
        {"input": "Who?", "answer": "Bob", "options": ["Ann", "Bob", "Cy", "Di"]},
        {"input": "Where?", "answer": "Rome", "options": ["Rome", "Oslo", "Lima", "Pisa"]}]},
    "scbench_qa_eng": {"id": 0, "context": "BOOK", "multi_turns": [
        {"input": "Who?", "answer": "Bob"}, {"input": "Where?", "answer": "Rome"}]},
    "scbench_qa_chn": {"id": 0, "context": "书", "multi_turns": [
        {"input": "谁？", "answer": ["小明去了"]}, {"input": "哪里？", "answer": ["北京"]}]},
    "scbench_many_shot": {"id": 0, "context": "SHOTS", "multi_turns": [
        {"input": "Q1", "answer": ["(A)"]}, {"input": "Q2", "answer": ["(C)"]}]},
    "scbench_mf": {"id": 0, "context": "[1, 42, 7]", "multi_turns": [
        {"input": "The max number in the list is", "answer": 42},
        {"input": "The min number in the list is", "answer": [1]}]},
    "scbench_summary": {"id": 0, "context": "PAPER", "multi_turns": [
        {"input": "Summarize.", "answer": "the cat sat on the mat"}, {"input": "Again.", "answer": "a dog ran"}]},
    "scbench_repoqa": {"id": 0, "context": "CODE", "repo": "r/x", "lang": "python", "multi_turns": [
        {"input": "Find foo.", "answer": FOO, "name": "foo"}, {"input": "Find bar.", "answer": BAR, "name": "bar"}]},
    "scbench_summary_with_needles": {"id": 0, "context": "PAPER", "multi_turns": [
        {"input": "Summarize.", "answer": "the cat sat on the mat", "task": "scbench_summary"},
        {"input": "The pass key?", "answer": "12345", "task": "scbench_passkey"}]},
    "scbench_repoqa_and_kv": {"id": 0, "context": "CODE", "repo": "r/x", "lang": "python", "multi_turns": [
        {"input": "Find foo.", "answer": FOO, "name": "foo", "task": "scbench_repoqa"},
        {"input": "Key: k", "answer": "v-1", "task": "scbench_kv"}]},
}
REPOQA_HEAD = ("Based on the function description and code context, please retrieve and repeat the exact described "
               "function from the code context in a code block wrapped by ```:\n\n")
# (turn 1 without a chat template, turn 2 without one, multi_request's context prompt, its question 2)
PROMPTS = {
    "scbench_choice_eng": (
        "Read the book and answer the question.\n\nBOOK\n\nQuestion: Who?\nA. Ann\nB. Bob\nC. Cy\nD. Di\n\n"
        "The the correct answer is",
        "Bob\n\nQuestion: Where?\nA. Rome\nB. Oslo\nC. Lima\nD. Pisa\n\nThe letter of the correct answer is",
        "Read the book and answer the question.\n\nBOOK",
        "Question: Where?\nA. Rome\nB. Oslo\nC. Lima\nD. Pisa\n\nThe the correct answer is"),
    "scbench_qa_eng": (
        "Read the book and answer the question. Be very concise in your answer.\n\nBOOK\n\nQuestion: Who?\nAnswer:",
        "Bob\n\nQuestion: Where?\nAnswer:",
        "Read the book and answer the question. Be very concise in your answer.\n\nBOOK",
        "Question: Where?\nAnswer:"),
    "scbench_qa_chn": ("阅读以下书籍然后回答问题。\n\n书\n\n问题：谁？\n答案：", "['小明去了']\n\n问题：哪里？\n答案：",
                       "阅读以下书籍然后回答问题。\n\n书", "问题：哪里？\n答案："),
    "scbench_many_shot": ("SHOTS\n\nQ1", "['(A)']\n\nQ2", "SHOTS", "Q2"),
    "scbench_mf": ("What is the max number in the list?\n\n[1, 42, 7]\n\nThe max number in the list is",
                   "42\n\nWhat is the min number in the list?\n\nThe min number in the list is",
                   "The max number in the list is\n\n[1, 42, 7]",  # create_scdq_prompt's prefix: turn 1's input
                   "What is the min number in the list?\n\nThe min number in the list is"),
    "scbench_summary": ("PAPER\n\nSummarize.", "the cat sat on the mat\n\nAgain.", "PAPER", "Again."),
    "scbench_repoqa": (REPOQA_HEAD + "CODE\n\nFind foo.", FOO + "\n\nFind bar.", REPOQA_HEAD + "CODE", "Find bar."),
    "scbench_summary_with_needles": ("PAPER\n\nSummarize.", "the cat sat on the mat\n\nThe pass key?", "PAPER",
                                     "The pass key?"),
    "scbench_repoqa_and_kv": ("CODE\n\nFind foo.", FOO + "\n\nKey: k", "CODE", "Key: k"),
}
# (prediction per turn, SCBench's score per turn)
SCORES = {
    "scbench_choice_eng": (["B. Bob", "The answer is: Oslo"], [1.0, 0.0]),
    "scbench_qa_eng": (["  it was bob.", "Paris"], [1.0, 0.0]),
    "scbench_qa_chn": (["小明。", "北京"], [2 / 3, 1.0]),  # characters: precision 1, recall 1/2
    "scbench_many_shot": (["(a) is right", "(B)"], [1.0, 0.0]),
    "scbench_mf": (["It is 42.9", "1"], [1.0, 1.0]),  # int(float("42.9")) == 42
    "scbench_summary": (["the cat sat", "a dog ran"], [2 / 3, 1.0]),  # ROUGE-L: P 1, R 1/2
    "scbench_repoqa": (["```python\n" + FOO + "\n```", "```python\n" + FOO + "\n```"], [1.0, 0.0]),
    "scbench_summary_with_needles": (["the cat sat", "It is 12345."], [2 / 3, 1.0]),
    "scbench_repoqa_and_kv": (["```\n" + FOO + "\n```", "the value is v-1"], [1.0, 1.0]),
}


def _sample(tmp_path, task):
    write_jsonl(tmp_path / f"{task}.jsonl", [ROWS[task]])
    sd.check_file(str(tmp_path), task)
    rows = sd.load_hub_samples(task, str(tmp_path), None)
    assert len(rows) == 1 and rows[0]["task"] == task
    return rows[0]


@pytest.mark.parametrize("task", sorted(ROWS))
def test_hub_row_loads_prompts_and_scores_as_scbench(tmp_path, task):
    sample = _sample(tmp_path, task)
    tok = smollm2_tokenizer()
    first, second, ctx, q2 = PROMPTS[task]
    turns = st.multi_turn_prompts(tok, sample, False, False)
    assert [t.text for t in turns] == [first, second]
    assert tok.decode(turns[0].ids) == first  # the context part compressed, the question appended
    ctx_text, _, qs = st.multi_request_prompts(tok, sample, False)
    assert ctx_text == ctx and qs[1][0] == q2
    preds, expected = SCORES[task]
    needles = st.repo_needles([sample])
    got = [st.score_turn(sample, k, p, needles) for k, p in enumerate(preds)]
    assert got == pytest.approx(expected, abs=1e-9)


def test_chat_follow_ups_as_scbench_builds_them(tmp_path):
    tok = smollm2_tokenizer()
    summary = _sample(tmp_path, "scbench_summary")
    turns = st.multi_turn_prompts(tok, summary, True, False)
    # create_multiturn_prompt: scbench_summary's chat follow-ups end with "This paper"
    assert turns[1].text == ("the cat sat on the mat<|im_end|>\n<|im_start|>user\nAgain.<|im_end|>\n"
                             "<|im_start|>assistant\nThis paper")
    choice = _sample(tmp_path, "scbench_choice_eng")
    turns = st.multi_turn_prompts(tok, choice, True, False)
    assert turns[1].text.startswith("Bob<|im_end|>\n<|im_start|>user\nQuestion: Where?\nA. Rome")
    assert turns[1].text.endswith("The the correct answer is<|im_end|>\n<|im_start|>assistant\n")


def test_scorers_transcribed():
    # longbook_choice_eng: first letter; an "answer is" prefix; the first A-D word
    assert sm.choice("C) no", ["x", "C"]) == 1.0 and sm.choice("", ["x", "C"]) == 0.0
    assert sm.choice("My answer is B", ["x", "B"]) == 1.0 and sm.choice("so, D", ["x", "D"]) == 1.0
    assert sm.choice("x", ["x", "A"]) == 1.0  # the whole prediction is the answer text
    # math_find: a float label compares floats
    assert sm.math_find("0.5 or 3", 0.5) == 1.0 and sm.math_find("no number", 3) == 0.0
    assert sm.math_find("7.0", 7.5) == 0.0
    # passkey: the first run of digits
    assert sm.passkey("key 1234 5", "12345") == 0.0 and sm.passkey("a12345b", ["12345"]) == 1.0
    # qa_f1_zh: punctuation (Chinese and ASCII) and whitespace removed; max over references
    assert sm.qa_f1_zh("北 京！", ["上海", "北京"]) == 1.0 and sm.qa_f1_zh("。", ["北京"]) == 0.0
    # summary: ROUGE-Lsum without stemming ("cats" is not "cat")
    assert sm.summary_rouge("cats", "cat") == 0.0
    # repoqa: the best-matching needle must be the one asked for, at similarity >= 0.8
    needles = [{"name": "foo", "needle": FOO}, {"name": "bar", "needle": BAR}]
    assert sm.repoqa(FOO, "foo", needles) == 1.0  # no code block: the whole output
    assert sm.repoqa("def foo(a, b):\n    return 0", "foo", needles) == 0.0  # below 0.8
    assert sm.repoqa("```\n" + BAR + "\n```\n```\n" + FOO + "\n```", "foo", needles) == 0.0  # the first block


def test_all_under_the_hub_source_is_every_hub_task():
    o = build_task("scbench", {"source": "hub", "data_dir": "/nowhere"}).options
    assert o.tasks == list(sd.HUB_TASKS)


def test_mixed_tasks_generate_per_subtask_and_report_per_subtask(tmp_path):
    sample = _sample(tmp_path, "scbench_repoqa_and_kv")
    t = build_task("scbench", {"source": "hub", "data_dir": str(tmp_path), "tasks": ["repoqa_and_kv"]})
    assert t.turn_max_new(sample) == [1024, 80]  # DATA_NAME_TO_MAX_NEW_TOKENS' dict, per turn
    m = st.score_turns([
        {"dataset": "scbench_repoqa_and_kv", "context_id": "a", "turn": 1, "score": 1.0, "subtask": "scbench_repoqa"},
        {"dataset": "scbench_repoqa_and_kv", "context_id": "a", "turn": 2, "score": 0.0, "subtask": "scbench_kv"}],
        ["scbench_repoqa_and_kv"])
    assert m["score_scbench_repoqa_and_kv_repoqa"] == 100.0 and m["score_scbench_repoqa_and_kv_kv"] == 0.0
    assert m["score_turn_1"] == 100.0 and m["score"] == 50.0


@pytest.mark.parametrize("mode", ["multi_turn", "multi_request"])
def test_run_through_the_app_on_a_hub_task(tmp_path, single_thread, mode):
    rows = [dict(ROWS["scbench_qa_eng"], id=i, context=f"Bob lives in Rome. Story {i}. " * 20) for i in range(2)]
    write_jsonl(tmp_path / "data" / "scbench_qa_eng.jsonl", rows)
    cfg = run_cfg(tmp_path, ["task=scbench", "task.source=hub", f"task.data_dir={tmp_path / 'data'}",
                             "task.tasks=[qa_eng]", f"task.mode={mode}", "task.turns=2", "task.length=600",
                             "task.max_new_tokens=4", "method=snapkv", "budget=64"])
    from kvbench.run.app import run

    metrics = run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert metrics["status"] == "ok", metrics.get("error")
    assert metrics["num_samples"] == 4
    for key in ("score_turn_1", "score_turn_2", "score_scbench_qa_eng_turn_1", "score_scbench_qa_eng"):
        assert 0.0 <= metrics[key] <= 100.0, key
    samples = [json.loads(line) for line in open(next(tmp_path.rglob("samples.jsonl")))]
    assert [s["turn"] for s in samples] == [1, 2, 1, 2]
    for s in samples:  # each record's score is SCBench's on its prediction
        ref = [r for r in rows if str(r["id"]) == s["context_id"]][0]["multi_turns"][s["turn"] - 1]["answer"]
        assert s["score"] == sm.dialogue_match(s["prediction"], [ref])


@pytest.mark.parametrize("mode", ["multi_turn", "multi_request"])
@pytest.mark.parametrize("chat", [False, True])
def test_a_long_hub_row_is_cut_so_the_whole_sequence_fits_task_length(mode, chat):
    """The context was cut to task.length minus what the turns generate, the turns' own prompts left out: SCBench hub
    rows of 9,054 and 8,488 tokens ran on an 8,192-position model. Now every turn's prompt counts."""
    tok = smollm2_tokenizer()
    words = " ".join(f"w{i} lorem" for i in range(3000))
    turns = [{"input": f"Question {k}: " + "what is the value of the key named alpha beta gamma? " * 20,
              "answer": "an answer of several words " * 10} for k in range(4)]
    sample = {"id": 0, "task": "scbench_qa_eng", "context": words, "multi_turns": turns}
    task = build_task("scbench", {"name": "scbench", "source": "hub", "tasks": ["qa_eng"], "length": 1500,
                                  "turns": 4, "mode": mode, "max_new_tokens": 16})
    fitted = task._fit(tok, sample, chat)
    longest = task._sample_tokens(tok, fitted, chat) + sum(task.turn_max_new(fitted))
    assert 1500 - 8 <= longest <= 1500, longest  # fills the length, never past it
    assert len(fitted["context"]) < len(words)
    old_cut = st._cut_middle(tok, sample, 1500 - sum(task.turn_max_new(sample)))  # the former rule
    assert task._sample_tokens(tok, old_cut, chat) + sum(task.turn_max_new(sample)) > 1500
    small = build_task("scbench", {"name": "scbench", "source": "hub", "tasks": ["qa_eng"], "length": 300,
                                   "turns": 4, "mode": mode, "max_new_tokens": 16})
    with pytest.raises(UserError, match="task.length=300 leaves no room for scbench_qa_eng sample 0's context: its "
                                        "turns' prompts take"):
        small._fit(tok, sample, chat)
