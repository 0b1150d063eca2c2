"""The Python API (kvbench/api.py): evaluate gives what `python -m kvbench` gives for the same config, the pipeline's
answer is the needle task's for the same prompt, bad arguments raise one ValueError, load_runs takes a list, and
`import kvbench` stays light."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness_fakes import CONF_DIR  # noqa: F401  (sets KVBENCH_CACHE_DIR for the subprocesses)
from tests.app.test_cli import REPO, kvbench, kvbench_env

import kvbench as kvb

PPL_ARGS = {"method": "h2o", "budget": 48, "task.max_tokens": 128, "task.chunk_size": 32, "logger.wandb": False,
            "progress": False, "runtime.threads": 1}
NEEDLE = {"length": 256, "depth": 50, "budget": 96, "max_new_tokens": 12}


def _cli_args(options: dict) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]


def _read(run_dir: str, name: str):
    with open(os.path.join(run_dir, name)) as f:
        return json.load(f) if name.endswith(".json") else [json.loads(line) for line in f if line.strip()]


def test_evaluate_gives_the_cli_metrics_and_folder(tmp_path):
    cli = kvbench(*_cli_args(PPL_ARGS), f"results_dir={tmp_path / 'cli'}", cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    [cli_folder] = [p for p in (tmp_path / "cli").iterdir() if p.is_dir()]
    cli_metrics = _read(str(cli_folder), "metrics.json")

    res = kvb.evaluate(results_dir=tmp_path / "api", **PPL_ARGS)
    assert isinstance(res, kvb.Results)
    assert res.run_dir == str(tmp_path / "api" / cli_folder.name)  # the same run id, so the same folder name
    assert res.metrics["run_id"] == cli_metrics["run_id"]
    assert res.metrics["config_hash"] == cli_metrics["config_hash"]
    for key in ("ppl", "nll", "num_samples", "peak_kv_bytes", "full_kv_bytes", "held_kv_bytes", "budget", "method"):
        assert res.metrics[key] == cli_metrics[key], key
    assert res.metrics == _read(res.run_dir, "metrics.json")
    assert res.samples == _read(res.run_dir, "samples.jsonl") and res.samples
    assert [r["run_id"] for r in _read(str(tmp_path / "api"), "runs.jsonl")] == [cli_metrics["run_id"]]
    frame = res.to_pandas()
    assert len(frame) == len(res.samples) and (frame["method"] == "h2o").all()
    assert res.to_pandas(samples=False).loc[0, "ppl"] == res["ppl"]

    # load_runs over a list of results folders: the CLI's run and the API's, in order
    runs = kvb.load_runs([tmp_path / "cli", str(tmp_path / "api")])
    assert [r["run_dir"] for r in runs] == [str(cli_folder), res.run_dir]
    with pytest.raises(ValueError, match="empty"):
        kvb.load_runs([])


def test_evaluate_without_a_results_folder_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = kvb.evaluate(results_dir=None, **{**PPL_ARGS, "budget": None, "method": "full"})
    assert res.run_dir is None and res.metrics["status"] == "ok" and res.samples
    assert list(tmp_path.iterdir()) == []  # not even the default results/


@pytest.mark.parametrize("call, needles", [
    (dict(method="nope"), ["unknown method 'nope'", "snapkv", "full"]),
    (dict(task="nope"), ["unknown task 'nope'", "needle"]),
    (dict(budget="lots"), ["budget", "'lots'"]),
    (dict(budget=64, compression_ratio=0.5), ["budget", "compression_ratio"]),
    (dict(nope=1), ["nope", "budget"]),
    (dict(rerun="yes"), ["rerun", "true or false"]),
])
def test_evaluate_bad_arguments_raise_one_value_error(tmp_path, call, needles):
    with pytest.raises(ValueError) as info:
        kvb.evaluate(results_dir=tmp_path, **{"logger.wandb": False}, **call)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    assert not (tmp_path / "runs.jsonl").exists()  # refused before anything was written


@pytest.fixture(scope="module")
def pipe():
    return kvb.pipeline(runtime={"threads": 1})


def test_pipeline_answer_is_the_needle_tasks(tmp_path, pipe):
    """kvpress's protocol (the context compressed, the question appended): the pipeline's answer and prompt equal
    the needle task's sample, run through the CLI, for the same context, question, method and budget."""
    from kvbench.data.needle import QUESTION_SUFFIX, SYSTEM_PROMPT, needle_grid

    n = NEEDLE
    cli = kvbench("task=needle", f"task.lengths=[{n['length']}]", f"task.depths=[{n['depth']}]",
                  "task.compress_question=false", f"task.max_new_tokens={n['max_new_tokens']}", "task.heatmap=false",
                  "method=snapkv", f"budget={n['budget']}", "logger.wandb=false", "progress=false",
                  "runtime.threads=1", f"results_dir={tmp_path}", cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    [folder] = [p for p in tmp_path.iterdir() if p.is_dir()]
    [sample] = _read(str(folder), "samples.jsonl")
    metrics = _read(str(folder), "metrics.json")

    [cell] = needle_grid(pipe.tokenizer, [n["length"]], [n["depth"]])
    out = pipe(cell.context, question=cell.question + QUESTION_SUFFIX, system_prompt=SYSTEM_PROMPT,
               method="snapkv", budget=n["budget"], max_new_tokens=n["max_new_tokens"])
    assert out["prompt"] == sample["prompt"]
    assert out["answer"] == sample["prediction"]
    assert out["peak_kv_bytes"] == metrics["peak_kv_bytes"] and out["held_kv_bytes"] == metrics["held_kv_bytes"]
    # the budget held per (layer, kv-head), then the question on top; less than an uncompressed cache
    assert metrics["kv_tokens_kept_mean"] <= n["budget"] < out["prompt_tokens"]
    assert metrics["kv_tokens_kept_mean"] < out["kept_tokens"] < out["prompt_tokens"]  # the question on top
    assert out["held_kv_bytes"] < out["full_kv_bytes"]

    full = pipe(cell.context, question=cell.question + QUESTION_SUFFIX, system_prompt=SYSTEM_PROMPT,
                max_new_tokens=n["max_new_tokens"])
    assert full["kept_tokens"] == full["prompt_tokens"] and full["held_kv_bytes"] == full["full_kv_bytes"]


@pytest.mark.parametrize("call, needles", [
    (dict(method="nope"), ["unknown method 'nope'", "snapkv"]),
    (dict(method="snapkv", budget=64, compression_ratio=0.5), ["budget", "compression_ratio"]),
    (dict(method="snapkv", compression_ratio=1.5), ["compression_ratio", "1.5"]),
    (dict(max_new_tokens=0), ["max_new_tokens", "0"]),
    (dict(method="snapkv", budget=64, nope=3), ["nope", "window"]),
    (dict(chat_template="maybe"), ["chat_template", "maybe", "auto"]),
])
def test_pipeline_bad_arguments_raise_one_value_error(pipe, call, needles):
    with pytest.raises(ValueError) as info:
        pipe("Some context.", question="What?", **call)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_pipeline_refuses_an_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'nope': choices are .*smollm2-135m"):
        kvb.pipeline("nope")


def test_import_kvbench_stays_light():
    """`import kvbench` (and so the CLI's start) imports neither the API nor torch, Hydra or pandas."""
    code = ("import sys, kvbench; "
            "print(sorted(m for m in ('torch', 'hydra', 'pandas', 'kvbench.api') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=kvbench_env(), capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    assert callable(kvb.evaluate) and callable(kvb.pipeline) and "evaluate" in dir(kvb)
    with pytest.raises(AttributeError):
        kvb.no_such_thing
