"""task=summarization (packaged ACLSum) and task=govreport (LongBench gov_report, ccdv full set from local files)."""
from __future__ import annotations

import json

import pytest

from kvbench.data.longbench import prompt_template
from kvbench.errors import UserError
from kvbench.metrics.rouge import rouge_l_official, rouge_score_f
from kvbench.tasks import build_task, no_progress
from tests.fixtures.task_fixtures import (ScriptedEngine, longbench_record, one_thread, run_cfg, smollm2_tokenizer,
                                          tiny_loader, write_jsonl)

single_thread = pytest.fixture(one_thread)
REPORT = ("The Government Accountability Office reviewed the agency's budget process. " * 6).strip()
SUMMARY = "GAO reviewed the agency budget process and found weaknesses."
KEYS = {"rouge_l", "rouge1", "rouge2", "rougeL", "rougeLsum"}


def test_options():
    o = build_task("summarization", {}).options
    assert (o.split, o.limit, o.reference, o.max_length) == ("test", 10, "aspects", 7500)
    g = build_task("govreport", {}).options
    assert (g.source, g.max_new_tokens) == ("longbench", 512)
    with pytest.raises(UserError, match="task.source"):
        build_task("govreport", {"source": "arxiv"})
    with pytest.raises(UserError, match="only the test split"):
        build_task("govreport", {"split": "train"})
    with pytest.raises(UserError, match="task.prompt needs a {document}"):
        build_task("summarization", {"prompt": "Summarize:"})
    with pytest.raises(UserError, match="task.reference"):
        build_task("summarization", {"reference": "title"})


def test_yaml_prompt_is_the_default():
    from tests.harness_fakes import compose
    from kvbench.tasks.summarization import DEFAULT_PROMPT

    assert compose(["task=summarization"]).task.prompt == DEFAULT_PROMPT


def test_aclsum_prompts_truncation_and_rouge():
    from kvbench.data.aclsum import load_aclsum

    tok = smollm2_tokenizer()
    docs = load_aclsum("test", limit=2)
    refs = {d["id"]: d["references"][0] for d in docs}
    task = build_task("summarization", {"limit": 2, "max_length": 300, "max_new_tokens": 128})

    def answer(prompt: str) -> str:  # the first paper gets its reference, the second something unrelated
        return refs[docs[0]["id"]] if docs[0]["document"][:200] in prompt else "Bananas are yellow."

    engine = ScriptedEngine(tok, answer)
    # keep the first paper's opening text in the prompt: truncation keeps the first max_length/2 tokens
    res = task.run(engine, tok, None, no_progress)
    s0, s1 = res.samples
    assert s0["id"] == docs[0]["id"] and s0["references"] == [refs[docs[0]["id"]]]
    assert s0["truncated"] is True and s0["prompt_tokens"] <= 300 + 40  # body cut to 300 tokens, plus template
    assert "You are given a scientific paper" in s0["prompt"] and s0["prompt"].endswith("<|im_start|>assistant\n")
    pred0 = tok.decode(tok.encode(refs[docs[0]["id"]], add_special_tokens=False)[:128], skip_special_tokens=True)
    assert s0["rouge_l"] == pytest.approx(rouge_l_official(pred0, [refs[docs[0]["id"]]]))
    assert s0["rouge1"] > 0.9 and s1["rouge1"] < 0.1
    assert KEYS <= set(res.metrics)
    assert res.metrics["rouge1"] == round(100 * (s0["rouge1"] + s1["rouge1"]) / 2, 2)
    assert res.metrics["num_documents"] == 2 and res.metrics["truncated"] == 2
    assert engine.calls[0]["max_new_tokens"] == 128


def test_govreport_longbench_local_file(tmp_path):
    tok = smollm2_tokenizer()
    d = tmp_path / "lb"
    write_jsonl(d / "gov_report.jsonl", [longbench_record("gov_report", 0, REPORT, "", [SUMMARY], 60),
                                         longbench_record("gov_report", 1, REPORT + " Second.", "", [SUMMARY], 61)])
    task = build_task("govreport", {"data_dir": str(d), "limit": 1})
    engine = ScriptedEngine(tok, lambda p: SUMMARY)
    res = task.run(engine, tok, None, no_progress)
    (s,) = res.samples
    filled = prompt_template("gov_report").format(context=REPORT)
    assert s["prompt"] == tok.apply_chat_template([{"role": "user", "content": filled}], add_generation_prompt=True,
                                                  tokenize=False)
    assert s["id"] == "gov_report-0000-9f3c2a" and s["dataset"] == "longbench/gov_report" and s["length"] == 60
    assert res.metrics["rouge_l"] == 100.0 and res.metrics["rougeLsum"] == 100.0
    assert res.metrics["source"] == "longbench"
    assert engine.calls[0]["max_new_tokens"] == 512


def test_govreport_ccdv_local_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = smollm2_tokenizer()
    folder = tmp_path / "ccdv" / "document"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"report": [REPORT, "Another report about roads."],
                             "summary": [SUMMARY, "Roads need repair."]}), folder / "test-00000-of-00001.parquet")
    task = build_task("govreport", {"source": "ccdv", "data_dir": str(tmp_path / "ccdv")})
    res = task.run(ScriptedEngine(tok, lambda p: "GAO reviewed the budget."), tok, {"runtime": {"batch_size": 2}},
                   no_progress)
    assert [s["id"] for s in res.samples] == ["govreport-test-0", "govreport-test-1"]
    assert res.samples[1]["references"] == ["Roads need repair."] and res.samples[0]["dataset"] == "govreport/test"
    expected = rouge_score_f("GAO reviewed the budget.", [SUMMARY])
    assert res.samples[0]["rouge2"] == pytest.approx(expected["rouge2"])
    assert res.metrics["source"] == "ccdv" and KEYS <= set(res.metrics)
    with pytest.raises(UserError, match="GovReport data not found"):
        build_task("govreport", {"source": "ccdv", "data_dir": str(tmp_path / "none")}).run(
            ScriptedEngine(tok, lambda p: ""), tok, None, no_progress)


def test_app_run_offline_default_summarization(tmp_path, single_thread):
    from kvbench.run.app import run

    cfg = run_cfg(tmp_path, ["task=summarization", "task.limit=2", "task.max_length=128", "task.max_new_tokens=6",
                             "runtime.batch_size=2"])
    rec = run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec["error"]
    assert rec["num_samples"] == 2 and KEYS <= set(rec) and rec["peak_kv_bytes"] > 0
    assert rec["ttft_s"] > 0 and rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0
    rows = [json.loads(x) for x in open(f"{rec['run_dir']}/samples.jsonl")]
    assert all(r["new_tokens"] >= 1 and r["prompt"] and r["references"] and "rouge1" in r for r in rows)
