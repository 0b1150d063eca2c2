"""The reasoning tasks and LongBench v2: hub-format local files, prompts, pass@1 over samples, the KV curve, answer
extraction and the accuracy table; a run through app.run on a tiny random model."""
from __future__ import annotations

import csv
import json
import os

import pytest

from kvbench.data import longbench_v2 as lv2
from kvbench.data import reasoning as rd
from kvbench.errors import UserError
from kvbench.tasks import build_task, no_progress
from tests.fixtures.task_fixtures import (ScriptedEngine, one_thread, run_cfg, smollm2_tokenizer, tiny_loader,
                                          write_jsonl)

single_thread = pytest.fixture(one_thread)


def _parquet(path, rows):
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


@pytest.fixture()
def hub_copies(tmp_path):
    """Each set as its hub repository lays it out (file names and columns)."""
    _parquet(tmp_path / "gsm8k" / "main" / "test-00000-of-00001.parquet", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A book costs $1,200. Two cost?", "answer": "2 * 1200 = 2400\n#### 2,400"}])
    write_jsonl(tmp_path / "math500" / "test.jsonl", [
        {"problem": "Compute $1/2 + 1/4$.", "solution": "...", "answer": "\\frac{3}{4}", "subject": "Algebra",
         "level": 1, "unique_id": "test/algebra/7.json"}])
    _parquet(tmp_path / "aime" / "aime24" / "data" / "train-00000-of-00001.parquet", [
        {"id": 60, "problem": "Find 2+2.", "solution": "4", "answer": "4", "url": "u", "year": "2024"}])
    write_jsonl(tmp_path / "aime" / "aime25" / "test.jsonl", [{"id": "0", "problem": "Find 3+3.", "answer": "6"}])
    return tmp_path


def test_loaders_read_the_hub_layouts(hub_copies):
    g = rd.load_reasoning("gsm8k", str(hub_copies / "gsm8k"))
    assert [r["question"][:3] for r in g] == ["Tom", "A b"] and rd.gsm8k_gold(g[1]["answer"]) == "2,400"
    m = rd.load_reasoning("math500", str(hub_copies / "math500"))
    assert m[0]["id"] == "math500-test/algebra/7.json" and m[0]["answer"] == "\\frac{3}{4}"
    a24 = rd.load_reasoning("aime24", str(hub_copies / "aime" / "aime24"))
    a25 = rd.load_reasoning("aime25", str(hub_copies / "aime" / "aime25"))
    assert (a24[0]["id"], a24[0]["answer"], a25[0]["answer"]) == ("aime24-60", "4", "6")
    assert len(rd.load_reasoning("math500", rd.SMOKE_DATA)) == 3  # the packaged smoke problems
    with pytest.raises(UserError, match="no 'test' split files"):
        rd.check_local("math500", str(hub_copies / "aime" / "aime24"))


def test_prompts_and_options():
    assert rd.reasoning_prompt("Q?").endswith("Please reason step by step, and put your final answer within "
                                              "\\boxed{}.")
    assert rd.reasoning_prompt("Q?", "rkv").startswith("You are given a math problem.\n\nProblem: Q?")
    task = build_task("aime", {"sets": [2025, 2024]})
    assert task.set_names() == ["aime25", "aime24"]
    for bad, text in [({"sets": ["1999"]}, "unknown AIME set '1999'"), ({"num_samples": 0}, "task.num_samples=0"),
                      ({"top_p": 1.5}, "task.top_p=1.5"), ({"temperature": -1}, "task.temperature=-1")]:
        with pytest.raises(UserError, match=text.replace("(", "\\(")):
            build_task("aime", bad)


def test_pass_at_1_averages_samples_per_problem():
    task = build_task("math500", {"num_samples": 2})
    rows = [{"id": "a", "correct": 1.0}, {"id": "a", "correct": 0.0}, {"id": "b", "correct": 1.0},
            {"id": "b", "correct": 1.0}]
    for r in rows:
        r.update(new_tokens=10, finish_reason="stop", max_table_tokens=5, kv_tokens_kept_end=4.0, kv_bytes_peak=9)
    m = task._metrics(rows)
    assert m["accuracy"] == 75.0 and m["num_problems"] == 2 and m["truncated_fraction"] == 0


def test_app_run_sampled_with_rkv_writes_the_kv_curve(tmp_path, hub_copies, single_thread):
    from kvbench.run.app import run

    rec = run(run_cfg(tmp_path, ["task=gsm8k", f"task.data_path={hub_copies / 'gsm8k'}", "task.num_samples=2",
                                 "task.max_new_tokens=40", "task.ignore_eos=true", "task.curve_every=8",
                                 "method=rkv", "budget=24", "method.buffer=8"]),
              load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec.get("error")
    assert rec["num_samples"] == 4 and rec["output_tokens_mean"] == 40
    samples = [json.loads(line) for line in open(os.path.join(rec["run_dir"], "samples.jsonl"))]
    per = {}
    for s in samples:
        per.setdefault(s["id"], []).append(s["flexible_extract"])
        assert s["max_table_tokens"] <= 24 + 7 and "Please reason step by step" in s["prompt"]
    assert rec["flexible_extract"] == round(100 * sum(sum(v) / len(v) for v in per.values()) / len(per), 2)
    assert rec["accuracy"] == rec["flexible_extract"] and rec["max_table_tokens"] <= 31
    with open(os.path.join(rec["run_dir"], "kv_curve.csv")) as f:
        curve = list(csv.DictReader(f))
    assert [int(r["new_tokens"]) for r in curve[:5]] == [8, 16, 24, 32, 40]
    assert all(int(r["max_table_tokens"]) <= 31 and int(r["kv_bytes"]) > 0 for r in curve)


# ------------------------------------------------------------------------------------------- LongBench v2
def _lb2_record(i, difficulty, length, answer):
    return {"_id": f"id{i}", "domain": "Single-Document QA", "sub_domain": "Legal", "difficulty": difficulty,
            "length": length, "question": f"Question number {i}?", "choice_A": "alpha", "choice_B": "beta",
            "choice_C": "gamma", "choice_D": "delta", "answer": answer, "context": " Some long document. " * 30}


def test_longbench_v2_prompt_and_extraction():
    p = lv2.build_prompt(_lb2_record(1, "easy", "short", "A"))
    assert p.startswith("Please read the following text and answer the question below.\n\n<text>\nSome long")
    assert "What is the correct answer to this question: Question number 1?\nChoices:\n(A) alpha\n(B) beta" in p
    assert p.endswith('Format your response as follows: "The correct answer is (insert answer here)".')
    assert lv2.extract_answer("**The correct answer is (C)**") == "C"
    assert lv2.extract_answer("The correct answer is D.") == "D"
    assert lv2.extract_answer("I think (B)") is None


def test_longbench_v2_query_agnostic_appends_the_question():
    tok = smollm2_tokenizer()
    rec = _lb2_record(3, "easy", "short", "A")
    for compress, chat in [(False, True), (False, False), (True, True)]:
        task = build_task("longbench_v2", {"compress_question": compress})
        req = task.build_request(tok, rec, 4000, chat, (2,))
        if compress:
            assert req.uncompressed_tail == 0
            continue
        tail = tok.decode(req.token_ids[-req.uncompressed_tail:])
        assert tail.startswith("What is the correct answer to this question: Question number 3?")
        assert "<text>" not in tail and tok.decode(req.token_ids[:-req.uncompressed_tail]).rstrip().endswith("</text>")


def test_longbench_v2_scores_by_difficulty_and_length(tmp_path):
    compress_question = True  # the scripted engine has generate() only (no uncompressed question step)
    data = tmp_path / "data.json"
    data.write_text(json.dumps([_lb2_record(0, "easy", "short", "A"), _lb2_record(1, "hard", "short", "B"),
                                _lb2_record(2, "hard", "long", "C")]))
    tok = smollm2_tokenizer()
    answers = {"Question number 0?": "The correct answer is (A)", "Question number 1?": "The correct answer is (C)",
               "Question number 2?": "The correct answer is C"}
    engine = ScriptedEngine(tok, lambda text: next(v for k, v in answers.items() if k in text))
    task = build_task("longbench_v2", {"data_path": str(data), "compress_question": compress_question})
    res = task.run(engine, tok, run_cfg(tmp_path, []), no_progress)
    m = res.metrics
    assert (m["accuracy"], m["accuracy_easy"], m["accuracy_hard"]) == (66.67, 100.0, 50.0)
    assert (m["accuracy_short"], m["accuracy_medium"], m["accuracy_long"]) == (50.0, None, 100.0)
    assert all(s["question_compressed"] == compress_question for s in res.samples)


def test_report_draws_kv_over_generation_from_the_curve(tmp_path):
    from kvbench.reporting import plots

    runs = []
    for name, grow in (("full", True), ("rkv", False)):
        d = tmp_path / name
        d.mkdir()
        with open(d / "kv_curve.csv", "w") as f:
            f.write("id,sample,new_tokens,max_table_tokens,mean_table_tokens,kv_bytes\n")
            for n in range(16, 161, 16):
                f.write(f"p0,0,{n},{n if grow else 64},{n if grow else 64},{(n if grow else 64) * 1024}\n")
            f.write("p1,0,16,16,16,16384\n")  # another generation: not drawn
        runs.append({"run_dir": str(d), "metrics": {"method": name, "budget": None if grow else 64}, "cfg": {}})
    assert plots.kv_curve(runs[0])[-1] == (160, 160 * 1024 / 2**20) and len(plots.kv_curve(runs[1])) == 10
    assert plots.kv_over_generation(runs).startswith(b"\x89PNG")
    assert plots.kv_over_generation([{"run_dir": str(tmp_path / "none"), "metrics": {}, "cfg": {}}]) is None
