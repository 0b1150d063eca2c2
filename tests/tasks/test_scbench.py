"""task=scbench (SCBench's multi-turn and multi-request modes): generated samples are deterministic under a seed and
fit the length, the hub format loads from local files, SCBench's scoring, the prompts as SCBench builds them, and
on the tiny model: multi_turn with full equals one long generation of the same turns, multi_request with full gives
each question the answer of an independent run, the context is compressed once per context (counted by the
method), forks share the context's blocks (the pool's figure), the prefix cache serves a repeated context from its
compressed copy, and a run through the app writes the per-turn scores and their summary line."""
from __future__ import annotations

import pytest

from kvbench.data import scbench as sd
from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.metrics import scbench as sm
from kvbench.tasks import build_task, no_progress
from kvbench.tasks import scbench as st
from kvbench.tasks._generation import decode, stop_token_ids
from tests.fixtures.task_fixtures import one_thread, run_cfg, smollm2_tokenizer, tiny_engine, tiny_loader, write_jsonl

single_thread = pytest.fixture(one_thread)
SMALL = {"length": 700, "turns": 3, "limit": 1, "max_new_tokens": 6}


def _task(**options):
    return build_task("scbench", {**SMALL, **options})


# --------------------------------------------------------------------------- options and data
def test_options_and_bad_values():
    o = build_task("scbench", {}).options
    assert o.mode == "multi_turn" and o.tasks == list(sd.GENERATED_TASKS) and o.turns == 5
    assert build_task("scbench", {"tasks": ["kv", "scbench_vt"]}).options.tasks == ["scbench_kv", "scbench_vt"]
    for bad, text in (({"mode": "chat"}, "task.mode='chat'"), ({"turns": 0}, "task.turns=0"),
                      ({"tasks": ["nope"]}, "unknown SCBench task 'nope'"), ({"length": -1}, "task.length=-1"),
                      ({"repeats": 2}, "task.repeats=2"),
                      ({"revision": "main"}, "task.revision is set but task.source='generate'")):
        with pytest.raises(UserError, match=text.replace("[", r"\[").replace("(", r"\(")):
            build_task("scbench", bad)


@pytest.mark.parametrize("task", sd.GENERATED_TASKS)
def test_generated_samples_are_deterministic_and_fit(task):
    tok = smollm2_tokenizer()
    t = _task(tasks=[task], limit=2)
    a, b = t.samples(tok, True), t.samples(tok, True)
    assert a == b and len(a) == 2 and a[0] != a[1]
    other = _task(tasks=[task], limit=2, seed=7).samples(tok, True)
    assert other[0]["context"] != a[0]["context"]
    for s in a:
        sd.check_record(s, "generated")
        assert len(s["multi_turns"]) == 3
        used = t._sample_tokens(tok, s, True) + 6 * 3
        assert 0.8 * 700 < used <= 700  # fitted: the largest size within the length
        for turn in s["multi_turns"]:  # every answer is in the context (vt: every variable)
            refs = turn["answer"] if isinstance(turn["answer"], list) else [turn["answer"]]
            assert all(r in s["context"] for r in refs)
    longer = _task(tasks=[task], limit=1, length=1400).samples(tok, True)[0]
    assert len(longer["context"]) > 1.5 * len(a[0]["context"])


def test_multi_hop_chains_across_turns():
    s = _task(tasks=["multi_hop"], turns=4).samples(smollm2_tokenizer(), True)[0]
    turns = s["multi_turns"]
    for k in range(1, len(turns)):  # turn k asks for the value of turn k-1's answer
        assert f"value of {turns[k - 1]['answer']}?" in turns[k]["input"]


def _hub_rows(n: int = 2) -> list[dict]:
    return [{"id": i, "context": f"{{\"k{i}a\": \"v{i}a\", \"k{i}b\": \"v{i}b\"}}",
             "multi_turns": [{"input": f'Key: "k{i}a"\nThe value associated with the specified key is: ',
                              "answer": f"v{i}a"},
                             {"input": f'Key: "k{i}b"\nThe value associated with the specified key is: ',
                              "answer": f"v{i}b"}]} for i in range(n)]


def test_hub_files_load_flat_and_in_the_hub_layout(tmp_path):
    write_jsonl(tmp_path / "flat" / "scbench_kv.jsonl", _hub_rows())
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "hub" / "scbench_kv").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(_hub_rows()), tmp_path / "hub" / "scbench_kv" / "test-00000-of-00001.parquet")
    for folder in ("flat", "hub"):
        sd.check_file(str(tmp_path / folder), "scbench_kv")
        rows = sd.load_hub_samples("scbench_kv", str(tmp_path / folder), None)
        assert [r["multi_turns"][1]["answer"] for r in rows] == ["v0b", "v1b"] and rows[0]["task"] == "scbench_kv"
    assert len(sd.load_hub_samples("scbench_kv", str(tmp_path / "flat"), 1)) == 1
    bad = tmp_path / "bad"
    write_jsonl(bad / "scbench_vt.jsonl", [{"id": 0, "context": "c", "multi_turns": [{"input": "q", "answer": 3}]}])
    with pytest.raises(ValueError, match=r"multi_turns\[0\]: 'input' must be text"):
        sd.check_file(str(bad), "scbench_vt")
    with pytest.raises(FileNotFoundError, match="no scbench_kv.jsonl"):
        sd.check_file(str(bad), "scbench_kv")


def test_hub_source_runs_turns_from_files(tmp_path, single_thread):
    write_jsonl(tmp_path / "scbench_kv.jsonl", _hub_rows())
    t = build_task("scbench", {"source": "hub", "data_dir": str(tmp_path), "tasks": ["kv"], "turns": 2,
                               "max_new_tokens": 4, "length": 512})
    t.preflight(None)
    r = t.run(tiny_engine(), smollm2_tokenizer(), None, no_progress)
    assert [s["turn"] for s in r.samples] == [1, 2, 1, 2] and r.samples[1]["references"] == ["v0b"]
    assert "v0a" in r.samples[1]["prompt"]  # turn 2 carries turn 1's reference answer (golden context)


def test_scoring_is_scbenchs():
    assert sm.kv_retrieval("the value is abc-123.", "abc-123") == 1.0
    assert sm.kv_retrieval("abc-12", "abc-123") == 0.0
    assert sm.string_match_all("They are: ABCDE, FGHIJ", ["abcde", "fghij", "KLMNO"]) == 0.67
    metrics = st.score_turns([
        {"dataset": "scbench_kv", "context_id": "a", "turn": 1, "score": 1.0},
        {"dataset": "scbench_kv", "context_id": "a", "turn": 2, "score": 0.0},
        {"dataset": "scbench_vt", "context_id": "b", "turn": 1, "score": 0.5},
        {"dataset": "scbench_vt", "context_id": "b", "turn": 2, "score": 0.5}], ["scbench_kv", "scbench_vt"])
    assert metrics["score_scbench_kv"] == 50.0 and metrics["score_turn_1"] == 75.0
    assert metrics["score_turn_2"] == 25.0 and metrics["score"] == 50.0 and metrics["score_scbench_vt_turn_2"] == 50.0


def test_prompts_as_scbench_builds_them():
    tok = smollm2_tokenizer()
    sample = {"task": "scbench_kv", "context": "{\"a\": \"1\"}",
              "multi_turns": [{"input": "Q1?", "answer": "A1"}, {"input": "Q2?", "answer": ["x", "y"]}]}
    turns = st.multi_turn_prompts(tok, sample, True, False)
    assert turns[0].text.endswith("JSON object below.\n\n{\"a\": \"1\"}\n\nQ1?<|im_end|>\n<|im_start|>assistant\n")
    # the follow-up continues the open assistant turn: the reference answer, then the next user turn
    assert turns[1].text == "A1<|im_end|>\n<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n"
    assert [c for _, c in turns[0].parts] == [True, False] and turns[1].parts[0][1] is False
    plain = st.multi_turn_prompts(tok, sample, False, True)
    assert plain[1].text == "A1\n\nQ2?" and len(plain[0].parts) == 1
    ctx_text, _, qs = st.multi_request_prompts(tok, sample, True)
    assert ctx_text.endswith("<|im_start|>user\nExtract the value corresponding to the specified key in the JSON "
                             "object below.\n\n{\"a\": \"1\"}")
    assert qs[0][0] == "Q1?<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------- the modes on the tiny model
@pytest.mark.parametrize("compress_question", [False, True])
def test_multi_turn_with_full_equals_one_long_generation(single_thread, compress_question):
    tok = smollm2_tokenizer()
    t = _task(tasks=["kv", "multi_hop"], compress_question=compress_question)
    r = t.run(tiny_engine(), tok, None, no_progress)
    stops = stop_token_ids(tok)
    ref_engine = tiny_engine()
    for sample in t.samples(tok, True):
        turns = st.multi_turn_prompts(tok, sample, True, compress_question)
        history: list[int] = []
        for k, turn in enumerate(turns, 1):
            history += turn.ids
            g = ref_engine.generate([history], max_new_tokens=6, stop_token_ids=stops)[0]
            rec = next(s for s in r.samples if s["context_id"] == sample["id"] and s["turn"] == k)
            assert rec["prediction"] == decode(tok, [x for x in g.token_ids if x not in stops]), (sample["id"], k)
    assert r.metrics["compressions_per_context"] == 0


def test_multi_request_with_full_equals_independent_runs(single_thread):
    tok = smollm2_tokenizer()
    t = _task(tasks=["kv", "vt"], mode="multi_request")
    engine = tiny_engine()
    r = t.run(engine, tok, None, no_progress)
    stops = stop_token_ids(tok)
    alone = tiny_engine()
    for sample in t.samples(tok, True):
        _, ctx, qs = st.multi_request_prompts(tok, sample, True)
        for k, (_, q) in enumerate(qs, 1):
            g = alone.generate([ctx + q], max_new_tokens=6, stop_token_ids=stops)[0]
            rec = next(s for s in r.samples if s["context_id"] == sample["id"] and s["turn"] == k)
            assert rec["prediction"] == decode(tok, [x for x in g.token_ids if x not in stops])
    assert r.metrics["context_shared_kv_bytes"] > 0 and r.metrics["shared_prompt_fraction"] > 0.5
    assert r.metrics["max_concurrent_requests"] == 3  # every question of a context served at once
    assert engine.cache.pool.in_use == 0  # every context and fork ended


def test_multi_request_compresses_each_context_once(single_thread):
    tok = smollm2_tokenizer()
    for compress_question, per_context in ((False, 1.0), (True, 4.0)):  # true: the context, then each fork's question
        t = _task(tasks=["kv", "prefix_suffix"], mode="multi_request", compress_question=compress_question)
        r = t.run(tiny_engine(build_method("snapkv", budget=64)), tok, None, no_progress)
        assert r.metrics["compressions_per_context"] == per_context
    mt = _task(tasks=["kv"], compress_question=True).run(tiny_engine(build_method("snapkv", budget=64)), tok, None,
                                                         no_progress)
    assert mt.metrics["compressions_per_context"] == 3.0  # multi_turn, question in view: once per turn


def test_prefix_cache_serves_a_repeated_context_compressed(single_thread):
    tok = smollm2_tokenizer()
    t = _task(tasks=["kv"], mode="multi_request", repeats=2)
    on = t.run(tiny_engine(build_method("snapkv", budget=64), prefix_caching=True), tok, None, no_progress)
    assert on.metrics["prefix_cache_hit_rate"] == 0.5 and on.metrics["compressions_per_context"] == 0.5
    first = [s["prediction"] for s in on.samples if s["repeat"] == 0]
    assert [s["prediction"] for s in on.samples if s["repeat"] == 1] == first
    assert [s["context_hit"] for s in on.samples] == [False] * 3 + [True] * 3
    off = t.run(tiny_engine(build_method("snapkv", budget=64), prefix_caching=False), tok, None, no_progress)
    assert off.metrics["prefix_cache_hit_rate"] is None and off.metrics["compressions_per_context"] == 1.0
    assert [s["prediction"] for s in off.samples] == [s["prediction"] for s in on.samples]


def test_run_through_the_app_writes_turn_scores(tmp_path, single_thread):
    from kvbench.run.app import run
    from kvbench.reporting.summary import format_summary

    cfg = run_cfg(tmp_path, ["task=scbench", "task.tasks=[kv]", "task.turns=2", "task.limit=1", "task.length=600",
                             "task.max_new_tokens=4", "method=streaming_llm", "budget=64"])
    metrics = run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert metrics["status"] == "ok", metrics.get("error")
    assert metrics["num_samples"] == 2  # one context, two turns: a sample record per turn
    for key in ("score_turn_1", "score_turn_2", "ttft_s_turn_1", "ttft_s_later_turns", "compressions_per_context",
                "peak_kv_bytes", "context_shared_kv_bytes"):
        assert metrics[key] is not None, key
    text = format_summary(metrics)
    assert "turns     score by turn: 1 " in text and "| 2 " in text
