"""task=needle: the grid, per-cell accuracy, the heatmap in the run folder, greedy answers equal to transformers'."""
from __future__ import annotations

import json
import os

import pytest
import torch

from kvbench.errors import UserError
from kvbench.tasks import build_task, no_progress
from kvbench.tasks._generation import run_generation, stop_token_ids
from tests.fixtures.task_fixtures import ScriptedEngine, one_thread, run_cfg, smollm2_tokenizer, tiny_loader

single_thread = pytest.fixture(one_thread)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_options():
    o = build_task("needle", {}).options
    assert o.lengths == [1024, 2048, 4096] and o.depths == [0, 25, 50, 75, 100]
    assert o.key_phrases == ["sandwich", "dolores park"] and o.system_prompt.startswith("You are a helpful AI bot")
    with pytest.raises(UserError, match="depth 150"):
        build_task("needle", {"depths": [150]})
    with pytest.raises(UserError, match="task.key_phrases"):
        build_task("needle", {"needle": "The code is 1234."})
    with pytest.raises(UserError, match="task.lengths"):
        build_task("needle", {"lengths": [0]})


def test_prompts_hold_the_needle_at_its_depth():
    tok = smollm2_tokenizer()
    task = build_task("needle", {"lengths": [256, 512], "depths": [0, 50, 100]})
    reqs = task.requests(tok)
    assert [r.id for r in reqs] == ["needle-256-0", "needle-256-50", "needle-256-100", "needle-512-0",
                                   "needle-512-50", "needle-512-100"]
    for r in reqs:
        assert "eat a sandwich and sit in Dolores Park" in r.prompt
        assert r.prompt.startswith("<|im_start|>system\nYou are a helpful AI bot")
        assert r.prompt.endswith("What is the best thing to do in San Francisco? Don't give information outside the "
                                 "document or repeat your findings<|im_end|>\n<|im_start|>assistant\n")
        assert r.token_ids == tok(r.prompt, add_special_tokens=False)["input_ids"]
        n = r.extra["context_length"]
        assert n - 8 <= len(r.token_ids) - 60 <= n + 8  # haystack + needle ~ length, plus template and question
    at = {r.id: r.prompt.index("sandwich") / len(r.prompt) for r in reqs}
    assert at["needle-512-0"] < 0.2 < at["needle-512-50"] < 0.8 < at["needle-512-100"]
    raw = build_task("needle", {"lengths": [256], "depths": [50], "chat_template": False}).requests(tok)
    assert not raw[0].prompt.startswith("<|im_start|>") and raw[0].prompt.endswith("repeat your findings")


def test_cells_metrics_and_heatmap(tmp_path):
    tok = smollm2_tokenizer()

    def answer(prompt: str) -> str:  # right at depth 0, half right at 50, wrong at 100
        where = prompt.index("sandwich") / len(prompt)
        return "Eat a sandwich in Dolores  Park." if where < 0.2 else ("A sandwich." if where < 0.8 else "No idea.")

    task = build_task("needle", {"lengths": [256, 512], "depths": [0, 50, 100]})
    task.output_dir = str(tmp_path / "run")
    engine = ScriptedEngine(tok, answer)
    res = task.run(engine, tok, {"runtime": {"batch_size": 4}}, no_progress)
    m = res.metrics
    assert m["acc_256_0"] == 1.0 and m["acc_256_50"] == 0.5 and m["acc_512_100"] == 0.0
    assert m["acc_len_512"] == pytest.approx(0.5) and m["acc_depth_50"] == 0.5
    assert m["accuracy"] == pytest.approx(0.5)
    assert [c["n"] for c in engine.calls] == [4, 2]  # batched by runtime.batch_size
    path = m["heatmap_png"]
    assert path == str(tmp_path / "run" / "needle_heatmap.png")
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    s = res.samples[1]
    assert s["id"] == "needle-256-50" and s["score"] == 0.5 and s["references"] == [
        "eat a sandwich and sit in Dolores Park on a sunny day"] and s["depth_percent"] == 50.0
    assert res.perf["ttft_s"] == 0.5 and res.perf["decode_tokens_per_s"] > 0


def test_app_run_writes_heatmap_into_run_folder(tmp_path, single_thread):
    from kvbench.run.app import run

    cfg = run_cfg(tmp_path, ["task=needle", "task.lengths=[128,256]", "task.depths=[0,100]",
                             "task.max_new_tokens=4", "runtime.batch_size=2"])
    rec = run(cfg, load_model_fn=tiny_loader(), print_summary=False)
    assert rec["status"] == "ok", rec["error"]
    assert rec["heatmap_png"] == os.path.join(rec["run_dir"], "needle_heatmap.png")
    with open(rec["heatmap_png"], "rb") as f:
        assert f.read(8) == PNG_MAGIC
    assert rec["num_samples"] == 4 and 0.0 <= rec["accuracy"] <= 1.0 and rec["peak_kv_bytes"] > 0
    assert rec["ttft_s"] > 0 and rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0
    rows = [json.loads(x) for x in open(os.path.join(rec["run_dir"], "samples.jsonl"))]
    assert [r["id"] for r in rows] == ["needle-128-0", "needle-128-100", "needle-256-0", "needle-256-100"]
    assert all("sandwich" in r["prompt"] for r in rows)


def test_greedy_answers_match_transformers(smollm2, single_thread):
    """Packaged SmolLM2, full cache: kvbench's greedy needle answers (batched) equal transformers' token for token."""
    from kvbench.runtime.serving.engine import Engine

    tok, hf = smollm2.tokenizer, smollm2.hf_model
    task = build_task("needle", {"lengths": [256, 640], "depths": [50], "max_new_tokens": 16})
    reqs = task.requests(tok)
    engine = Engine(smollm2.model, None, prefill_chunk_size=256)
    outs, perf = run_generation(engine, tok, reqs, batch_size=2)
    stops = list(stop_token_ids(tok, generation_config=hf.generation_config))
    for req, out in zip(reqs, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([req.token_ids]), attention_mask=torch.ones(1, len(req.token_ids),
                              dtype=torch.long), do_sample=False, max_new_tokens=16, eos_token_id=stops,
                              pad_token_id=tok.eos_token_id)
        ref_new = ref[0, len(req.token_ids):].tolist()
        assert out.token_ids == ref_new, (req.id, out.prediction, tok.decode(ref_new))
        assert len(out.token_ids) >= 2
    assert perf["decode_tokens_per_s"] > 0
