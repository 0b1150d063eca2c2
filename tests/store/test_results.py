"""The results folder: atomic files, runs.jsonl, skip-if-finished, failed and interrupted runs."""
from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings, strategies as st

from tests.harness_fakes import FakeEngine, compose, fake_build_method, fake_loader
from kvbench.run import app, exit_channel
from kvbench.commands import hydra_task
from kvbench.store.files import append_jsonl, atomic_write_text, read_jsonl, write_json
from kvbench.store.folder import REQUIRED_FIELDS, RunFolder, complete_record, finished_metrics
from kvbench.store.naming import config_hash
from kvbench.store.runs import load_runs
from kvbench.store.table import group_columns, runs_frame
from kvbench.errors import UserError


def run_fake(tmp_path, overrides=(), fail=None, **kw):
    cfg = compose([f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4",
                   *overrides])
    return app.run(cfg, load_model_fn=fake_loader(fail=fail), engine_cls=FakeEngine,
                   build_method_fn=fake_build_method, print_summary=kw.pop("print_summary", False), **kw)


def test_atomic_write_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "metrics.json"
    write_json(str(target), {"a": 1})

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        write_json(str(target), {"a": 2})
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]  # no temp file left


def test_atomic_files_are_readable_by_others(tmp_path):
    atomic_write_text(str(tmp_path / "x.txt"), "hi")
    assert (tmp_path / "x.txt").stat().st_mode & 0o044 == 0o044


def test_jsonl_append_and_torn_lines(tmp_path):
    path = str(tmp_path / "runs.jsonl")
    append_jsonl(path, {"run_id": "a", "x": float("nan")})
    with open(path, "a") as f:
        f.write('{"run_id": "torn')  # an interrupted writer
    append_jsonl(path, {"run_id": "b"})
    recs = read_jsonl(path)
    assert [r["run_id"] for r in recs] == ["a", "b"]
    assert recs[0]["x"] is None  # NaN is written as null


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "method", "task", "runtime", "budget", "seed"]),
                       st.one_of(st.integers(), st.text(max_size=5),
                                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=3)), max_size=6))
def test_config_hash_ignores_key_order(d):
    assert config_hash(d) == config_hash(dict(reversed(list(d.items()))))


def test_complete_record_has_every_field():
    rec = complete_record({"ppl": 3.0, "run_id": "r"})
    for key in REQUIRED_FIELDS:
        assert key in rec
    assert list(rec)[: len(REQUIRED_FIELDS)] == list(REQUIRED_FIELDS)
    assert rec["ppl"] == 3.0


def test_successful_run_writes_the_contract(tmp_path):
    rec = run_fake(tmp_path, ["budget=32", "method.name=fake", "+method.window=3"])
    run_dir = tmp_path / rec["run_id"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for key in REQUIRED_FIELDS:
        assert key in metrics, key
    assert metrics["status"] == "ok" and metrics["error"] is None
    assert metrics["method"] == "fake" and metrics["budget"] == 32 and metrics["task"] == "perplexity"
    assert metrics["method_window"] == 3 and metrics["method_budget"] == 32
    assert metrics["num_samples"] == 1 and metrics["peak_kv_bytes"] == 4000 and metrics["full_kv_bytes"] == 8000
    assert metrics["prefill_tokens_per_s"] > 0 and metrics["decode_tokens_per_s"] is None
    assert metrics["ttft_s"] is None and metrics["wall_s"] >= 0
    assert metrics["torch"] and metrics["transformers"] and metrics["kvbench"]
    assert "git_commit" in metrics and metrics["device"] == "cpu" and metrics["dtype"] == "float32"
    assert math.isfinite(metrics["ppl"]) and metrics["num_tokens"] == 39
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 1 and {"id", "dataset", "prompt", "prediction", "references", "ppl"} <= set(samples[0])
    assert "budget: 32" in (run_dir / "config.yaml").read_text()
    runs = read_jsonl(str(tmp_path / "runs.jsonl"))
    assert len(runs) == 1 and runs[0]["run_id"] == rec["run_id"]
    df = runs_frame(load_runs(str(tmp_path)))
    assert list(df["budget"]) == [32]


def test_finished_run_is_skipped_unless_rerun(tmp_path, capsys):
    FakeEngine.instances.clear()
    first = run_fake(tmp_path, ["budget=32"])
    capsys.readouterr()
    second = run_fake(tmp_path, ["budget=32"], print_summary=True)
    assert second == first and len(FakeEngine.instances) == 1
    out = capsys.readouterr().out
    assert "skipping" in out and "kvbench run OK" in out and "ppl" in out  # the stored summary, printed again
    third = run_fake(tmp_path, ["budget=32", "rerun=true"])
    assert third["run_id"] == first["run_id"] and len(FakeEngine.instances) == 2
    assert len(read_jsonl(str(tmp_path / "runs.jsonl"))) == 2


def test_failed_run_is_recorded_and_retried(tmp_path):
    rec = run_fake(tmp_path, ["budget=16"], fail=RuntimeError("out of blocks"))
    run_dir = tmp_path / rec["run_id"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "failed" and "RuntimeError: out of blocks" in metrics["error"]
    assert "Traceback" in (run_dir / "error.txt").read_text()
    assert finished_metrics(str(run_dir)) is None
    ok = run_fake(tmp_path, ["budget=16"])  # a failed run is not skipped
    assert ok["status"] == "ok" and not (run_dir / "error.txt").exists()
    statuses = [r["status"] for r in read_jsonl(str(tmp_path / "runs.jsonl"))]
    assert statuses == ["failed", "ok"]


def test_interrupted_run_is_not_a_result(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run_fake(tmp_path, ["budget=8"], fail=KeyboardInterrupt())
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "metrics.json").read_text())["error"] == "interrupted"
    assert finished_metrics(str(run_dir)) is None
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


def test_rerun_start_drops_the_old_marker(tmp_path):
    folder = RunFolder(str(tmp_path), "r1")
    folder.start("a: 1\n")
    folder.finish({"run_id": "r1", "status": "ok"})
    assert folder.finished()
    folder.start("a: 1\n")  # a new attempt: until it finishes, there is no result
    assert folder.finished() is None and not os.path.exists(folder.file("metrics.json"))


def test_bad_input_found_during_the_run_is_recorded_and_raised(tmp_path):
    # a one-character text is one token: known only once the tokenizer has read it (bad paths are refused before)
    text = tmp_path.parent / f"{tmp_path.name}-one-char.txt"
    text.write_text("a")
    cfg = compose([f"results_dir={tmp_path}", "logger.wandb=false", "task=perplexity", f"task.text_file={text}"])
    with pytest.raises(UserError, match="no text with at least 2 tokens"):
        app.run(cfg, load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method,
                print_summary=False)
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "failed"


def test_main_keeps_a_sweep_going_and_sets_the_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr(exit_channel, "_exit_code", 0)
    calls = []

    def fake_run(cfg, run_dir=None):
        calls.append(cfg.budget)
        if cfg.budget == 1:
            return {"status": "failed", "error": "x"}
        if cfg.budget == 2:
            raise UserError("bad")
        return {"status": "ok"}

    monkeypatch.setattr(app, "run", fake_run)
    hydra_task.main(compose(["budget=1"]))
    assert exit_channel.exit_code() == 1
    hydra_task.main(compose(["budget=2"]))
    hydra_task.main(compose(["budget=3"]))
    assert calls == [1, 2, 3] and exit_channel.exit_code() == 2


def test_summary_fits_one_screen(tmp_path):
    from kvbench.reporting.summary import format_summary

    rec = run_fake(tmp_path, ["budget=32"])
    text = format_summary(rec, str(tmp_path))
    lines = text.splitlines()
    assert len(lines) < 25 and max(len(line) for line in lines) <= 100
    assert "ppl" in text and "perplexity" in text and "50.0% saved by" in text and "KV pool" in text


def test_every_setting_is_a_column_and_experiments_group(tmp_path):
    for tokens in (40, 48):
        for budget in (8, 16):
            run_fake(tmp_path, [f"task.max_tokens={tokens}", f"budget={budget}", "method=h2o"])
    df = runs_frame(load_runs(str(tmp_path)))
    assert sorted(df["task_max_tokens"]) == [40, 40, 48, 48]
    assert set(df["runtime_block_size"]) == {16} and "runtime_threads" not in df.columns  # threads: speed only
    assert set(df["task_corpus"]) == {"pg_essays"} and set(df["quant"]) == {"none"}
    cols = group_columns(df)
    assert "task_max_tokens" in cols and "runtime_block_size" in cols
    assert not {"method", "budget", "quant", "method_window"} & set(cols)
    groups = df.groupby(cols, dropna=False)
    assert len(groups) == 2 and all(len(g) == 2 for _, g in groups)
    assert df.groupby("experiment_key").ngroups == 2
    assert df.groupby("config_hash").ngroups == 4


def test_wall_s_counts_loading_too(tmp_path):
    import time

    base = fake_loader()

    def slow_loader(*a, **k):
        time.sleep(0.3)
        return base(*a, **k)

    cfg = compose([f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4", "budget=8"])
    rec = app.run(cfg, load_model_fn=slow_loader, engine_cls=FakeEngine, build_method_fn=fake_build_method,
                  print_summary=False)
    assert rec["wall_s"] >= 0.3


def test_codec_summary_is_one_storage_line():
    from kvbench.reporting.summary import format_summary

    rec = complete_record({
        "run_id": "r", "status": "ok", "method": "full", "quant": "kivi", "task": "perplexity", "ppl": 12.5,
        "peak_kv_bytes": 300, "full_kv_bytes": 1000, "held_kv_bytes": 300, "kv_bytes_per_token": 40.0,
        "storage_codec": "kivi",
        "storage_codec_bits": 2, "storage_codec_group_size": 32, "storage_packed_bits_per_element": 3.0,
        "storage_fp_block_dtype": "float32", "storage_block_size": 32, "storage_packed_key_bytes_per_block": 1,
        "task_max_tokens": 1024, "runtime_block_size": 16, "quant_bits": 2})
    text = format_summary(rec)
    assert text.count("storage") == 1 and "kivi (bits=2, group_size=32)" in text and "3 bits/element" in text
    assert "storage_" not in text and "task_max_tokens" not in text and "ppl 12.5" in text
    assert "70.0% saved by codec" in text and "full + kivi" in text and "full-precision window" in text
    assert max(len(line) for line in text.splitlines()) <= 78


def test_no_git_checkout_asks_git_nothing(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(app.kvbench, "__file__", str(tmp_path / "kvbench" / "__init__.py"))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("git was run")))
    assert app._git_commit() is None


@pytest.mark.parametrize("method_seed,expected", [("null", 7), (3, 3)])
def test_the_top_level_seed_reaches_the_method(tmp_path, method_seed, expected):
    seen = {}

    def build(name, budget=None, *, seed=None, **options):  # the interface of methods.build_method
        seen["seed"] = seed
        return fake_build_method(name, budget, **options)

    overrides = ["method=kvcrush", "budget=8", "seed=7", f"method.seed={method_seed}"]
    cfg = compose([f"results_dir={tmp_path}", *overrides])
    app.plan_run(cfg, build_method_fn=build)
    assert seen["seed"] == expected


def test_codec_shorthand_is_recorded_resolved(tmp_path):
    import yaml

    rec = run_fake(tmp_path, ["method=kivi", "budget=64"])
    assert (rec["method"], rec["quant"], rec["budget"], rec["quant_bits"]) == ("full", "kivi", None, 2)
    saved = yaml.safe_load((tmp_path / rec["run_id"] / "config.yaml").read_text())
    assert saved["method"] == {"name": "full"} and saved["quant"]["name"] == "kivi" and saved["budget"] is None
    again = run_fake(tmp_path, ["method=full", "quant=kivi"])  # the same run, spelled the other way
    assert again["run_id"] == rec["run_id"] and again["attempt_id"] == rec["attempt_id"]
