"""task=ruler: generated samples fit the length in the packaged tokenizer, are deterministic for a seed, score as
RULER's functions do, load from kvpress's hub format, and run end to end on the tiny model."""
from __future__ import annotations

import json
import os

import pytest

from kvbench.data import ruler as rd
from kvbench.errors import UserError
from kvbench.metrics import ruler as rm
from kvbench.tasks import build_task, no_progress
from tests.fixtures.task_fixtures import ScriptedEngine, one_thread, run_cfg, smollm2_tokenizer, tiny_loader

single_thread = pytest.fixture(one_thread)
SYNTHETIC = [t for t in rd.TASK_NAMES if t not in rd.QA_TASKS]


def _tokens(tok, sample) -> int:
    return len(tok(sample["context"] + sample["question"] + sample["answer_prefix"],
                   add_special_tokens=False)["input_ids"])


def write_qa_files(folder) -> str:
    """RULER's squad.json (SQuAD 2.0 layout) and hotpotqa.json (HotpotQA dev layout), small."""
    paras = [{"context": f"Paragraph {i} tells that the river number {i} is called Riv{i}er and is long.",
              "qas": [{"question": f"What is river {i} called?", "answers": [{"text": f"Riv{i}er"}],
                       "is_impossible": False},
                      {"question": "Unanswerable?", "answers": [], "is_impossible": True}]} for i in range(40)]
    squad = {"data": [{"title": "Rivers", "paragraphs": paras[:20]}, {"title": "More", "paragraphs": paras[20:]}]}
    hotpot = [{"question": f"Which city hosts tower {i}?", "answer": f"Town{i}",
               "context": [[f"Tower {i}", [f"Tower {i} stands in Town{i}. ", "It is tall."]],
                           [f"Bridge {i}", [f"Bridge {i} is red."]]]} for i in range(40)]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "squad.json"), "w") as f:
        json.dump(squad, f)
    with open(os.path.join(folder, "hotpotqa.json"), "w") as f:
        json.dump(hotpot, f)
    return str(folder)


def test_options():
    o = build_task("ruler", {}).options
    assert o.tasks == list(rd.TASK_NAMES) and len(o.tasks) == 13 and o.lengths == [4096]
    assert o.compress_question is False and o.source == "generate" and o.seed == 42
    assert build_task("ruler", {"tasks": "vt"}).options.tasks == ["vt"]
    with pytest.raises(UserError, match="unknown RULER task 'niah'.*choices are all, niah_single_1"):
        build_task("ruler", {"tasks": ["niah"]})
    with pytest.raises(UserError, match="task.source='web'"):
        build_task("ruler", {"source": "web"})
    with pytest.raises(UserError, match="task.limit=0"):
        build_task("ruler", {"limit": 0})


@pytest.mark.parametrize("task", SYNTHETIC)
def test_generated_samples_fit_4096_in_the_packaged_tokenizer(task):
    tok = smollm2_tokenizer()
    samples = rd.generate_samples(task, 4096, tok, 3, seed=42)
    assert len(samples) == 3
    gen = rd.tokens_to_generate(task)
    for s in samples:
        n = _tokens(tok, s)
        assert n + gen <= 4096 and s["length"] == n + gen
        assert n + gen > 4096 * 0.45, f"{task}: haystack not fitted ({n} tokens)"
        assert s["task"] == task and s["max_new_tokens"] == gen
        assert rd.QUESTION_PATTERNS[rd.task_family(task)].match(s["question"])
        assert rd.ANSWER_PATTERNS[rd.task_family(task)].match(s["answer_prefix"])
        if task != "fwe":  # fwe's answers are the most frequent coded words, present many times
            assert all(a in s["context"] for a in s["answer"])
        else:
            counts = [s["context"].split().count(a) for a in s["answer"]]
            assert counts == sorted(counts, reverse=True) and counts[-1] > 1
    if task.startswith("niah"):
        expect = {"niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
        assert all(len(s["answer"]) == expect for s in samples)
        key_in_question = samples[0]["question"].split(" for ")[1].split(" mentioned")[0]
        assert key_in_question.split(",")[0] in samples[0]["context"]
    if task == "vt":
        assert all(len(s["answer"]) == 5 for s in samples)
        assert "VAR " in samples[0]["context"] and samples[0]["context"].count("Memorize and track") == 2  # + example
    if task == "cwe":
        assert all(len(s["answer"]) == 10 for s in samples)


def test_qa_tasks_from_local_files_and_skipped_without(tmp_path, capsys):
    tok = smollm2_tokenizer()
    qa_dir = write_qa_files(tmp_path / "qa")
    for task, answer in (("qa_1", "Riv0er"), ("qa_2", "Town0")):
        (s,) = rd.generate_samples(task, 1024, tok, 1, seed=42, qa_dir=qa_dir)
        assert s["answer"] == [answer] and answer in s["context"] and _tokens(tok, s) + 32 <= 1024
        assert s["context"].count("Document ") > 5 and s["question"].startswith("Answer the question based")
    task = build_task("ruler", {"tasks": ["niah_single_1", "qa_1", "qa_2"], "lengths": [1024], "limit": 1})
    reqs = task.requests(tok)
    assert [r.dataset for r in reqs] == ["niah_single_1"]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == ["kvbench: ruler: qa_1 skipped: it needs RULER's squad.json in task.data_dir (task.data_dir is "
                   "not set)", "kvbench: ruler: qa_2 skipped: it needs RULER's hotpotqa.json in task.data_dir "
                   "(task.data_dir is not set)"]


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_3", "vt", "cwe", "fwe"])
def test_generation_is_deterministic_for_a_seed(task):
    tok = smollm2_tokenizer()
    a = rd.generate_samples(task, 1024, tok, 2, seed=7)
    b = rd.generate_samples(task, 1024, tok, 2, seed=7)
    c = rd.generate_samples(task, 1024, tok, 2, seed=8)
    assert a == b
    assert [s["context"] for s in a] != [s["context"] for s in c]


def test_scoring_equals_rulers_functions():
    preds = ["The numbers are 1234567 and 7654321.", "Only 1234567 here", "nothing", "ANSWER: Paris"]
    refs = [["1234567", "7654321"], ["1234567", "7654321"], ["1234567"], ["paris", "lyon"]]
    # RULER: all = mean over samples of the share of references found; part = mean of "any reference found"
    assert rm.string_match_all(preds, refs) == round(100 * (1 + 0.5 + 0 + 0.5) / 4, 2) == 50.0
    assert rm.string_match_part(preds, refs) == round(100 * (1 + 1 + 0 + 1) / 4, 2) == 75.0
    assert rm.string_match_all(["a b c"], [["A", "B", "d"]]) == 66.67  # case-insensitive, rounded to 2 decimals
    assert rm.postprocess("  x\ty\x01z \n") == "x\ny\nz"
    assert rm.metric_for("qa_1") is rm.match_part and rm.metric_for("niah_single_1") is rm.match_all
    try:  # lm-eval's string_match_all is RULER's (its string_match_part is not: it averages like match_all)
        from lm_eval.tasks.ruler.common_utils import string_match_all as lm_all
    except Exception:
        return
    for p, r in zip(preds, refs):
        assert rm.match_all(p, r) == lm_all([p], [r])


def _hub_rows() -> list[dict]:
    rows = []
    for i in range(3):
        rows.append({"context": f"Some text. One of the special magic numbers for key-{i} is: 100{i}. More text.\n",
                     "question": f"What is the special magic number for key-{i} mentioned in the provided text? ",
                     "answer_prefix": f"The special magic number for key-{i} mentioned in the provided text is",
                     "answer": [f"100{i}"], "task": "niah_single_1", "max_new_tokens": 128})
    for i in range(2):
        rows.append({"context": f"Memorize.\n\nVAR ABCDE = 5000{i}\nVAR FGHIJ = VAR ABCDE\n",
                     "question": f"Question: Find all variables that are assigned the value 5000{i} in the text "
                                 "above. ",
                     "answer_prefix": "Answer: According to the chain(s) of variable assignment in the text above, "
                                      f"2 variables are assigned the value 5000{i}, they are: ",
                     "answer": ["ABCDE", "FGHIJ"], "task": "vt", "max_new_tokens": 30})
    return rows


@pytest.mark.parametrize("layout", ["jsonl", "parquet_folder"])
def test_hub_format_from_data_dir(tmp_path, layout):
    import pandas as pd

    tok = smollm2_tokenizer()
    rows = _hub_rows()
    if layout == "jsonl":
        with open(tmp_path / "4096.jsonl", "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    else:  # as the hub repository holds a subset: <subset>/test-00000-of-00001.parquet
        (tmp_path / "4096").mkdir()
        pd.DataFrame(rows).to_parquet(tmp_path / "4096" / "test-00000-of-00001.parquet")
    opts = {"source": "hub", "data_dir": str(tmp_path), "tasks": ["niah_single_1", "vt"], "limit": 2,
            "compress_question": True}
    task = build_task("ruler", opts)
    reqs = task.requests(tok)
    assert [r.id for r in reqs] == ["niah_single_1-4096-0", "niah_single_1-4096-1", "vt-4096-0", "vt-4096-1"]
    assert reqs[2].references == ["ABCDE", "FGHIJ"] and reqs[2].max_new_tokens == 30
    end = tok("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert all(r.uncompressed_tail > len(end) and r.question_tokens > 0 for r in reqs)  # kvpress: appended after
    r = reqs[0]
    assert r.token_ids[-r.uncompressed_tail:][:len(end)] == end  # the turn's end, then the answer prefix
    question = tok.decode(r.token_ids[-r.uncompressed_tail - r.question_tokens: -r.uncompressed_tail])
    assert question.startswith("What is the special magic") and question.rstrip().endswith("?")
    assert reqs[0].prompt.startswith("<|im_start|>system") and reqs[0].prompt.endswith(
        "<|im_end|>\n<|im_start|>assistant\nThe special magic number for key-0 mentioned in the provided text is")

    def answer(prompt: str) -> str:  # right on niah sample 0 and vt sample 0 (one of two variables), else wrong
        if "key-0 mentioned" in prompt:
            return " 1000."
        return " ABCDE" if "value 50000" in prompt else " nothing"

    engine = ScriptedEngine(tok, answer)
    res = task.run(engine, tok, None, no_progress)
    assert res.metrics["score_niah_single_1"] == 50.0 and res.metrics["score_vt"] == 25.0
    assert res.metrics["score"] == 37.5 and res.metrics["num_samples_vt"] == 2
    split = build_task("ruler", {**opts, "compress_question": False}).requests(tok)
    assert all(r.uncompressed_tail > 0 for r in split)
    assert tok.decode(split[0].token_ids[-split[0].uncompressed_tail:]).startswith("What is the special magic")


def test_hub_data_with_wrong_columns_is_refused(tmp_path):
    with open(tmp_path / "4096.jsonl", "w") as f:
        f.write(json.dumps({"input": "x", "outputs": ["y"], "task": "vt"}) + "\n")
    with pytest.raises(UserError, match="RULER data for length 4096: .*4096.jsonl:1: no 'context', 'question', "
                                        "'answer_prefix', 'answer', 'max_new_tokens' field"):
        build_task("ruler", {"source": "hub", "data_dir": str(tmp_path), "tasks": ["vt"]}).requests(
            smollm2_tokenizer())


def test_end_to_end_tiny_model_with_a_compression_ratio(tmp_path, single_thread):
    from kvbench.run.app import run

    cfg = run_cfg(tmp_path, ["task=ruler", "task.tasks=[niah_single_1,vt,fwe]", "task.lengths=[1024]",
                             "task.limit=1", "method=snapkv", "compression_ratio=0.5", "runtime.batch_size=2"])
    rec = run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec["error"]
    assert rec["compression_ratio"] == 0.5 and rec["budget"] is None and rec["method_compression_ratio"] == 0.5
    assert rec["num_samples"] == 3 and rec["task_compress_question"] is False
    for t in ("niah_single_1", "vt", "fwe"):
        assert 0.0 <= rec[f"score_{t}"] <= 100.0
    assert rec["score"] == round((rec["score_niah_single_1"] + rec["score_vt"] + rec["score_fwe"]) / 3, 2)
    assert rec["score_tasks"] == "niah_single_1,vt,fwe" and "score_tasks_skipped" not in rec
    # the context was compressed to about half (the method's own minimum aside); the question was not compressed
    assert 0.4 <= rec["kv_kept_fraction"] <= 0.5
    assert rec["peak_kv_bytes"] < rec["full_kv_bytes"]
    rows = [json.loads(x) for x in open(os.path.join(rec["run_dir"], "samples.jsonl"))]
    assert [r["id"] for r in rows] == ["niah_single_1-1024-0", "vt-1024-0", "fwe-1024-0"]
    assert rows[0]["prompt"].endswith("mentioned in the provided text is")
    with open(os.path.join(rec["run_dir"], "metrics.json")) as f:
        assert json.load(f)["compression_ratio"] == 0.5


def test_score_names_the_tasks_it_averages_and_the_summary_says_so():
    """Without squad.json / hotpotqa.json, qa_1 / qa_2 are skipped and `score` averages 11 tasks, not 13: the
    record says which (score_tasks) and which were skipped, and so does the run's summary."""
    from kvbench.reporting.summary import format_summary
    from kvbench.tasks.ruler import score_results

    samples = [{"dataset": t, "score": v, "length": 1024} for t, v in (("niah_single_1", 1.0), ("vt", 0.5))]
    m = score_results(samples, ["niah_single_1", "qa_1", "vt", "qa_2"], [1024])
    assert m["score"] == 75.0 and m["score_tasks"] == "niah_single_1,vt" and m["score_tasks_skipped"] == "qa_1,qa_2"
    assert "score_tasks_skipped" not in score_results(samples, ["niah_single_1", "vt"], [1024])
    text = format_summary({"run_id": "r", "status": "ok", "task": "ruler", **m})
    assert "score the mean over 2 tasks: niah_single_1, vt (qa_1, qa_2 skipped: no data)" in " ".join(text.split())
    assert "score_tasks " not in text  # not repeated among the metrics


def test_split_question_tokenizes_context_question_and_suffix_apart():
    """kvpress's query-aware parts (tasks._generation.split_question, for ruler and the Python pipeline): the
    context with its special tokens, then the question and what follows it, each tokenized apart; the counts are
    the question's (the method's window) and the suffix's (appended after compression)."""
    from kvbench.tasks._generation import encode, split_question
    tok = smollm2_tokenizer()
    prompt = "<|im_start|>user\nA long context. What is it?<|im_end|>\n<|im_start|>assistant\nAnswer:"
    start = prompt.index("What")
    end = start + len("What is it?")
    ids, question, tail = split_question(tok, prompt, start, end, True)
    parts = [encode(tok, prompt[:start], True), tok(prompt[start:end], add_special_tokens=False)["input_ids"],
             tok(prompt[end:], add_special_tokens=False)["input_ids"]]
    assert ids == parts[0] + parts[1] + parts[2]
    assert (question, tail) == (len(parts[1]), len(parts[2])) and tail > 0
    assert split_question(tok, prompt[:end], start, end, True) == (parts[0] + parts[1], len(parts[1]), 0)
