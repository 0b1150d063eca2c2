"""task=longbench / longbench_e: local files in the hub's format, prompts, truncation, chat rules, scoring, batching."""
from __future__ import annotations

import json

import pytest

from kvbench.data.longbench import LONGBENCH_DATASETS, LONGBENCH_E_DATASETS, prompt_template
from kvbench.errors import UserError
from kvbench.tasks import build_task, no_progress
from kvbench.tasks.longbench import build_request
from tests.fixtures.task_fixtures import (ScriptedEngine, longbench_record, one_thread, run_cfg, smollm2_tokenizer,
                                          tiny_loader, write_jsonl)

single_thread = pytest.fixture(one_thread)

QASPER_CTX = "The experiments use the CoNLL-2003 corpus. " * 4
TREC_CTX = "Question: Who wrote Hamlet?\nType: Human being\nQuestion: Where is Paris?\nType: City"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture()
def data_dir(tmp_path):
    """Small <dataset>.jsonl files written the way THUDM/LongBench's data.zip holds them."""
    d = tmp_path / "longbench"
    write_jsonl(d / "qasper.jsonl", [
        longbench_record("qasper", 0, QASPER_CTX, "Which corpus is used?", ["CoNLL-2003", "the CoNLL-2003 corpus"],
                         120),
        longbench_record("qasper", 1, QASPER_CTX, "Is it English?", ["yes"], 130),
    ])
    write_jsonl(d / "trec.jsonl", [
        longbench_record("trec", 0, TREC_CTX, "Question: Who painted the Mona Lisa?\nType:", ["Human being"], 40,
                         all_classes=["Human being", "City", "Country"]),
    ])
    write_jsonl(d / "samsum.jsonl", [
        longbench_record("samsum", 0, "Dialogue: A: hi\nSummary: greeting", "Dialogue: B: bye\nSummary:",
                         ["B says goodbye."], 20),
    ])
    write_jsonl(d / "multifieldqa_zh.jsonl", [
        longbench_record("multifieldqa_zh", 0, "北京是中国的首都。", "中国的首都是哪里？", ["北京"], 9),
    ])
    write_jsonl(d / "passage_count.jsonl", [
        longbench_record("passage_count", 0, "Paragraph 1: a\n\nParagraph 2: b", "", ["2"], 10),
    ])
    write_jsonl(d / "qasper_e.jsonl", [
        longbench_record("qasper_e", 0, QASPER_CTX, "Which corpus is used?", ["CoNLL-2003"], 3000),
        longbench_record("qasper_e", 1, QASPER_CTX, "Which corpus is used?", ["CoNLL-2003"], 5000),
        longbench_record("qasper_e", 2, QASPER_CTX, "Which corpus is used?", ["CoNLL-2003"], 9000),
    ])
    return d


ANSWERS = {  # prompt fragment -> scripted model answer
    "Which corpus is used?": "CoNLL-2003",
    "Is it English?": "no",  # wrong
    "Who painted the Mona Lisa?": "Human being\nCity",  # first line only: right
    "B: bye": "B says goodbye.\nmore text",  # first line only
    "中国的首都是哪里": "北京",
    "Paragraph 2": "There are 2 paragraphs",
}


def answer(prompt: str) -> str:
    return next(v for k, v in ANSWERS.items() if k in prompt)


def test_options_and_dataset_groups():
    assert build_task("longbench", {}).options.datasets == list(LONGBENCH_DATASETS)
    assert len(LONGBENCH_DATASETS) == 21
    assert build_task("longbench_e", {}).options.datasets == list(LONGBENCH_E_DATASETS)
    assert build_task("longbench", {"datasets": ["zh", "qasper"]}).options.datasets[-1] == "qasper"
    assert build_task("longbench", {"datasets": "qasper"}).options.datasets == ["qasper"]
    with pytest.raises(UserError, match="unknown LongBench dataset 'nope'"):
        build_task("longbench", {"datasets": ["nope"]})
    with pytest.raises(UserError, match="task.limit"):
        build_task("longbench", {"limit": -1})
    with pytest.raises(UserError, match="task.chat_template"):
        build_task("longbench", {"chat_template": "sometimes"})


def test_request_prompt_truncation_and_chat_rules(tok, data_dir):
    from kvbench.data.longbench import load_longbench

    stops = (2,)
    (qasper, _) = load_longbench("qasper", data_dir=str(data_dir))
    req = build_request(tok, "qasper", qasper, 7500, True, stops)
    filled = prompt_template("qasper").format(context=qasper["context"], input=qasper["input"])
    assert req.prompt == tok.apply_chat_template([{"role": "user", "content": filled}], add_generation_prompt=True,
                                                 tokenize=False)
    assert req.token_ids == tok(req.prompt, add_special_tokens=False)["input_ids"]
    assert req.max_new_tokens == 128 and req.references == ["CoNLL-2003", "the CoNLL-2003 corpus"]
    assert req.extra["truncated"] is False and req.extra["chat_template"] is True

    # middle truncation: the first and last max_length/2 tokens of the filled prompt, before the template
    short = build_request(tok, "qasper", qasper, 40, True, stops)
    ids = tok.encode(filled)
    kept = tok.decode(ids[:20], skip_special_tokens=True) + tok.decode(ids[-20:], skip_special_tokens=True)
    assert short.extra["truncated"] is True
    assert short.prompt == tok.apply_chat_template([{"role": "user", "content": kept}], add_generation_prompt=True,
                                                   tokenize=False)
    assert "You are given a scientific article" in short.prompt and short.prompt.rstrip().endswith("assistant")

    (trec,) = load_longbench("trec", data_dir=str(data_dir))
    raw = build_request(tok, "trec", trec, 7500, True, stops)  # few-shot sets are never templated
    assert raw.prompt == prompt_template("trec").format(context=trec["context"], input=trec["input"])
    assert raw.extra["chat_template"] is False and raw.max_new_tokens == 64

    (samsum,) = load_longbench("samsum", data_dir=str(data_dir))
    s = build_request(tok, "samsum", samsum, 7500, True, stops)
    newline = tok.encode("\n", add_special_tokens=False)[-1]
    assert set(s.stop_ids) == {2, newline}  # pred.py stops samsum at "\n" too


def test_run_scores_per_dataset_and_buckets(tok, data_dir):
    datasets = ["qasper", "trec", "samsum", "multifieldqa_zh", "passage_count", "qasper_e"]
    task = build_task("longbench", {"datasets": datasets, "data_dir": str(data_dir)})
    engine = ScriptedEngine(tok, answer)
    res = task.run(engine, tok, None, no_progress)
    m = res.metrics
    assert m["score_qasper"] == 50.0  # one right (max over references), one wrong
    assert m["score_trec"] == 100.0 and m["score_samsum"] == 100.0  # first-line rule
    assert m["score_multifieldqa_zh"] == 100.0 and m["score_passage_count"] == 100.0
    assert m["score_qasper_e"] == 100.0
    assert m["score_qasper_e_0-4k"] == m["score_qasper_e_4-8k"] == m["score_qasper_e_8k+"] == 100.0
    assert m["score_0-4k"] == 100.0
    assert m["score"] == round((50 + 100 * 5) / 6, 2)
    assert m["score_zh"] == 100.0 and m["score_en"] == round((50 + 400) / 5, 2)
    assert m["num_samples_qasper"] == 2 and m["max_length"] == 7500
    assert len(res.samples) == 9
    s0 = res.samples[0]
    assert {"id", "dataset", "prompt", "prediction", "references", "score", "ttft_s", "length"} <= set(s0)
    assert s0["id"] == "qasper-0000-9f3c2a" and s0["dataset"] == "qasper" and s0["prediction"] == "CoNLL-2003"
    assert s0["score"] == 1.0 and res.samples[1]["score"] == 0.0
    assert [c["max_new_tokens"] for c in engine.calls] == [128, 128, 64, 128, 64, 32, 128, 128, 128]
    assert res.perf["ttft_s"] == 0.5 and res.perf["prefill_tokens_per_s"] > 0 and res.perf["peak_kv_bytes"] == 4096


def test_batches_group_same_settings(tok, data_dir):
    task = build_task("longbench", {"datasets": ["qasper", "trec", "qasper_e"], "data_dir": str(data_dir)})
    engine = ScriptedEngine(tok, answer)
    cfg = {"runtime": {"batch_size": 2}}
    res = task.run(engine, tok, cfg, no_progress)
    # qasper (2) | trec (1, other settings) | qasper_e (2 + 1)
    assert [c["n"] for c in engine.calls] == [2, 1, 2, 1]
    assert res.metrics["score_qasper"] == 50.0 and len(res.samples) == 6


def test_missing_file_is_a_user_error(tmp_path):
    task = build_task("longbench", {"datasets": ["qasper"], "data_dir": str(tmp_path)})
    with pytest.raises(UserError, match="qasper.jsonl"):
        task.run(ScriptedEngine(smollm2_tokenizer(), answer), smollm2_tokenizer(), None, no_progress)


def test_app_run_on_tiny_model_batched_equals_unbatched(tmp_path, data_dir, single_thread):
    """Through app.run (metrics.json + samples.jsonl) on a tiny random model: batch_size 2 gives the same tokens."""
    from kvbench.run.app import run

    common = ["task=longbench", f"task.data_dir={data_dir}", "task.datasets=[qasper,trec]", "task.max_length=64",
              "runtime.prefill_chunk_size=32"]
    rec1 = run(run_cfg(tmp_path, common + ["runtime.batch_size=1"]), load_model_fn=tiny_loader(),
               print_summary=False)
    rec2 = run(run_cfg(tmp_path, common + ["runtime.batch_size=2"]), load_model_fn=tiny_loader(),
               print_summary=False)
    for rec in (rec1, rec2):
        assert rec["status"] == "ok", rec["error"]
        assert rec["num_samples"] == 3 and rec["ttft_s"] > 0
        assert rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0 and rec["peak_kv_bytes"] > 0
        assert "score_qasper" in rec and "score_trec" in rec and "score" in rec
    rows = [[json.loads(x) for x in open(f"{r['run_dir']}/samples.jsonl")] for r in (rec1, rec2)]
    assert [r["prediction"] for r in rows[0]] == [r["prediction"] for r in rows[1]]
    assert all(r["prompt_tokens"] <= 64 + 40 for r in rows[0])  # truncated to 64 tokens + the chat template
    assert rows[0][0]["new_tokens"] >= 1 and rows[0][0]["prompt"].startswith("<|im_start|>system")


def test_workload_counts_a_local_copys_rows_without_a_limit(data_dir):
    """Issue 67 item 3: LongBench prints its work (and a time) first: a limit per dataset, else the rows of a local
    copy; hub data without a limit is known only once read."""
    from kvbench.data.longbench import max_new_tokens

    work = build_task("longbench", {"datasets": ["qasper", "trec"], "data_dir": str(data_dir)}).workload(None)
    assert (work.prompts, work.prompt_tokens) == (3, 3 * 7500)
    assert work.new_tokens == 2 * max_new_tokens("qasper") + max_new_tokens("trec")
    assert build_task("longbench", {"datasets": ["qasper"]}).workload(None) is None
