"""Data- and tensor-parallel runs through the command line (torchrun, 2 gloo processes on CPU, bounded in time):
rank 0 writes one run folder whose metrics and samples equal a one-process run's; a killed rank leaves the run
failed, and a rerun redoes it; bad input is refused in one line (exit 2) before the model loads."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.task_fixtures import smollm2_tokenizer
from tests.app.test_bad_input import cli  # noqa: F401  (the in-process CLI fixture)
from tests.tiny_models import SMOLLM2_TOKEN_IDS, tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 150
TASK = ["task=perplexity", "task.num_documents=4", "task.max_tokens=96", "task.chunk_size=32",
        "method=streaming_llm", "budget=48", "logger=none", "runtime.threads=1", "progress=false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1",
               KVBENCH_DIST_TIMEOUT_S="60")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _kvbench(*args: str, nproc: int = 1, kill_rank: int | None = None) -> subprocess.CompletedProcess:
    if nproc == 1 and kill_rank is None:
        cmd = [sys.executable, "-m", "kvbench", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", "-m", "tests.distributed_cli",
               *([f"--kill-rank={kill_rank}"] if kill_rank is not None else []), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"  # 4 query heads over 2 kv-heads
    tiny_hf_model(seed=0, vocab=len(smollm2_tokenizer()), max_positions=8192, **SMOLLM2_TOKEN_IDS).save_pretrained(
        folder)
    smollm2_tokenizer().save_pretrained(folder)
    return folder


def _only_run(results: Path) -> tuple[dict, list[dict]]:
    runs = [p for p in results.iterdir() if (p / "metrics.json").exists()]
    assert len(runs) == 1, runs
    samples = [json.loads(line) for line in (runs[0] / "samples.jsonl").read_text().splitlines()]
    return json.loads((runs[0] / "metrics.json").read_text()), samples


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp1")
    p = _kvbench("model=hf", f"model.path={model_dir}", *TASK, f"results_dir={out}")
    assert p.returncode == 0, p.stderr[-3000:]
    return _only_run(out)


def test_data_parallel_run_equals_one_process(model_dir, tmp_path, one_process):
    p = _kvbench("model=hf", f"model.path={model_dir}", *TASK, f"results_dir={tmp_path}", nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics, samples = _only_run(tmp_path)
    ref, ref_samples = one_process
    assert metrics["status"] == "ok" and metrics["num_samples"] == ref["num_samples"] == 4
    for key in ("ppl", "nll", "num_tokens", "ppl_pos_0_512"):
        assert metrics[key] == ref[key], key
    assert [s["id"] for s in samples] == [s["id"] for s in ref_samples]  # complete, in sample order
    assert [s["nll"] for s in samples] == [s["nll"] for s in ref_samples]
    assert metrics["data_parallel"] == 2 and metrics["tensor_parallel"] == 1
    for rank in (0, 1):  # each rank measured its own share
        assert metrics[f"prefill_tokens_per_s_rank{rank}"] > 0
        assert metrics[f"peak_kv_bytes_rank{rank}"] == ref["peak_kv_bytes"]  # one document at a time, same sizes
        assert metrics[f"num_samples_rank{rank}"] == 2  # 4 documents dealt over 2 ranks
    assert metrics["peak_kv_bytes"] == ref["peak_kv_bytes"]  # the most one replica held
    assert metrics["run_id"] == ref["run_id"]  # the world size is not a setting of the result
    assert len(list(tmp_path.glob("*/.hydra"))) == 1 and (tmp_path / "runs.jsonl").read_text().count("\n") == 1


# Tasks that drive the engine themselves split their work too: reasoning deals whole batches (each keeps its seed,
# so sampled generations match one process), lm-eval deals documents through its own rank hooks.
SELF_DRIVEN = {
    "gsm8k": ["task=gsm8k", "task.data_path=kvbench:smoke", "task.num_samples=2", "task.max_new_tokens=6",
              "runtime.batch_size=2", "method=streaming_llm", "budget=32"],
    "lm_eval": ["task=lm_eval", "task.tasks=[kvbench_essays_mc]", "task.include_defaults=false", "task.limit=5",
                "method=snapkv", "budget=32"],
}
COMMON = ["logger=none", "runtime.threads=1", "progress=false"]


@pytest.mark.parametrize("task", sorted(SELF_DRIVEN))
def test_self_driven_tasks_split_over_data_parallel_ranks(model_dir, tmp_path, task):
    args = ["model=hf", f"model.path={model_dir}", *SELF_DRIVEN[task], *COMMON]
    one = _kvbench(*args, f"results_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _kvbench(*args, f"results_dir={tmp_path / 'two'}", nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    (ref, ref_samples), (metrics, samples) = _only_run(tmp_path / "one"), _only_run(tmp_path / "two")
    assert metrics["status"] == "ok" and metrics["data_parallel"] == 2
    assert len(samples) == len(ref_samples) == ref["num_samples"] == metrics["num_samples"] > 2
    assert [(s["id"], s["prediction"]) for s in samples] == [(s["id"], s["prediction"]) for s in ref_samples]
    for key in ("accuracy", "score"):
        if key in ref:
            assert metrics[key] == ref[key], key
    for rank in (0, 1):  # each rank computed a share: its own figures
        assert metrics[f"peak_kv_bytes_rank{rank}"] > 0 and 0 < metrics[f"num_samples_rank{rank}"]
    if task == "gsm8k":  # 6 generations in 3 batches of 2: batches 0 and 2 on rank 0, batch 1 on rank 1
        assert (metrics["num_samples_rank0"], metrics["num_samples_rank1"]) == (4, 2)


def test_tensor_parallel_run_sums_the_ranks_pools(model_dir, tmp_path, one_process):
    p = _kvbench("model=hf", f"model.path={model_dir}", *TASK, "runtime.tensor_parallel=2",
                 f"results_dir={tmp_path}", nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics, samples = _only_run(tmp_path)
    ref, _ = one_process
    assert metrics["status"] == "ok" and metrics["tensor_parallel"] == 2 and metrics["data_parallel"] == 1
    assert metrics["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)
    assert metrics["peak_kv_bytes_rank0"] == metrics["peak_kv_bytes_rank1"] == ref["peak_kv_bytes"] // 2
    assert metrics["peak_kv_bytes"] == ref["peak_kv_bytes"]  # summed over the ranks' pools
    assert metrics["full_kv_bytes"] == ref["full_kv_bytes"] and metrics["runtime_tensor_parallel"] == 2
    assert metrics["run_id"] != ref["run_id"]


def _kill_rank_1_mid_run(model_dir, tmp_path) -> list:
    """Launch on 2 ranks with rank 1 killed after loading; check that no finished run is left (a failed record, or
    none); return the command's arguments for a rerun."""
    args = ["model=hf", f"model.path={model_dir}", *TASK, f"results_dir={tmp_path}"]
    p = _kvbench(*args, nproc=2, kill_rank=1)
    assert p.returncode != 0
    finished = [json.loads(m.read_text()) for m in tmp_path.glob("*/metrics.json")]
    assert all(m["status"] == "failed" for m in finished), finished  # recorded failed, or not at all
    assert not any((m.parent / "samples.jsonl").exists() and (m.parent / "samples.jsonl").stat().st_size
                   for m in tmp_path.glob("*/metrics.json"))
    index = tmp_path / "runs.jsonl"
    assert not index.exists() or all(json.loads(line)["status"] == "failed"
                                     for line in index.read_text().splitlines() if line.strip())
    return args


def test_a_killed_rank_fails_the_run_cleanly(model_dir, tmp_path):
    """A rerun redoes a failed record as it does any failed run (tests/store/test_results.py; here in the slow
    tier)."""
    _kill_rank_1_mid_run(model_dir, tmp_path)


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_and_a_rerun_redoes_it(model_dir, tmp_path):
    args = _kill_rank_1_mid_run(model_dir, tmp_path)
    p = _kvbench(*args)  # the rerun in one process: the failed record is redone as by any rerun
    assert p.returncode == 0, p.stderr[-3000:]
    metrics, samples = _only_run(tmp_path)
    assert metrics["status"] == "ok" and len(samples) == 4


@pytest.mark.parametrize("args, expected", [
    (["runtime.tensor_parallel=2"], "invalid runtime.tensor_parallel=2: larger than the 1 process(es)"),
    (["model=smollm2-135m", "runtime.tensor_parallel=2", "+WORLD=2"], "the model's 3 kv-heads are not divisible by 2"),
    (["runtime.tensor_parallel=2", "+WORLD=2", "method=kvcrush", "budget=64"],
     "method 'kvcrush' cannot run with runtime.tensor_parallel=2: its token signatures"),
    (["runtime.tensor_parallel=2", "+WORLD=2", "method=tova", "budget=64"], "use tova.heads=per_head"),
    (["task=throughput", "+WORLD=2"], "task=throughput serves one trace on one engine, not split over 2"),
    (["runtime.tensor_parallel=2", "+WORLD=2", "runtime.preemption=swap"],
     "runtime.preemption=swap cannot run with runtime.tensor_parallel=2"),
])
def test_bad_parallel_input_is_one_line_before_load(cli, monkeypatch, model_dir, tmp_path, args,  # noqa: F811
                                                   expected):
    """The real CLI entry in this process (one case also as a subprocess, below)."""
    import kvbench.run.app as app

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded for bad input")

    monkeypatch.setattr(app, "_load_model", no_loading)
    if "+WORLD=2" in args:  # as torchrun would say it, without starting the process group (refused before that)
        args = [a for a in args if a != "+WORLD=2"]
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "0")
    model = [] if any(a.startswith("model=") for a in args) else ["model=hf", f"model.path={model_dir}"]
    code, out, err = cli([*model, *args, "logger=none", f"results_dir={tmp_path}"])
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], err
    assert "Traceback" not in out + err and not list(tmp_path.glob("*/metrics.json"))


def test_bad_parallel_input_as_a_real_subprocess(model_dir, tmp_path):
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "0"}
    p = subprocess.run([sys.executable, "-m", "kvbench", "model=smollm2-135m", "runtime.tensor_parallel=2",
                        "logger=none", f"results_dir={tmp_path}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "the model's 3 kv-heads are not divisible by 2" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and not list(tmp_path.glob("*/metrics.json"))
