"""Sweeps through Hydra's launchers into one results folder: joblib (parallel processes) and submitit_local (what
submitit_slurm runs on a cluster). Each run lands in results_dir/<run_id> and is recorded exactly once; a failed run
in a worker process still makes the sweep exit non-zero. A budget sweep over a method that evicts nothing runs once."""
from __future__ import annotations

import importlib.util

import pytest

from tests.harness_fakes import run_fake_cli
from kvbench.store.files import read_jsonl

needs_joblib = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                                  reason="hydra-joblib-launcher is not installed (pip install '.[launchers]')")
needs_submitit = pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
                                    reason="hydra-submitit-launcher is not installed (pip install '.[launchers]')")


def _check_layout(out, budgets):
    runs = read_jsonl(str(out / "runs.jsonl"))
    assert sorted(r["budget"] for r in runs if r["status"] == "ok") == sorted(budgets)
    assert len({r["run_id"] for r in runs}) == len(runs)  # each run once
    for r in runs:  # each run in results_dir/<run_id>, with Hydra's files inside it
        assert (out / r["run_id"] / "metrics.json").exists() and (out / r["run_id"] / ".hydra").is_dir()
    return runs


@needs_joblib
def test_joblib_sweep_records_every_run_once_and_reports_failures(tmp_path):
    out = tmp_path / "r"
    proc = run_fake_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "budget=8,16,24,32,-1",
                        f"results_dir={out}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 2, proc.stderr  # budget=-1 was refused before any job started, in any worker
    assert "invalid budget=-1" in proc.stderr and not out.exists()
    proc = run_fake_cli("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "budget=8,16,24,32",
                        f"results_dir={out}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    runs = _check_layout(out, [8, 16, 24, 32])
    assert len(runs) == 4 and len({r["pid"] for r in runs}) >= 1


@needs_submitit
def test_submitit_local_sweep(tmp_path):
    out = tmp_path / "r"
    proc = run_fake_cli("-m", "hydra/launcher=submitit_local", "budget=8,16", f"results_dir={out}", cwd=tmp_path,
                        timeout=240)
    assert proc.returncode == 0, proc.stderr
    _check_layout(out, [8, 16])


@needs_submitit
def test_submitit_tasks_of_one_job_form_one_data_parallel_run(tmp_path):
    """hydra.launcher.tasks_per_node=2: each job's two tasks join one launch (kvbench.runtime.model.distributed reads
    the job's ranks from submitit), split the documents and write one folder per run, recorded once."""
    import json

    out = tmp_path / "r"
    proc = run_fake_cli("-m", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                        "task.num_documents=2", "budget=8,16", f"results_dir={out}", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    for run in _check_layout(out, [8, 16]):
        metrics = json.loads((out / run["run_id"] / "metrics.json").read_text())
        assert (metrics["world_size"], metrics["data_parallel"], metrics["num_samples"]) == (2, 2, 2)
        assert metrics["num_samples_rank0"] == metrics["num_samples_rank1"] == 1  # one document each


def test_budget_sweep_over_a_method_that_keeps_every_token_runs_once(tmp_path):
    out = tmp_path / "r"
    proc = run_fake_cli("-m", "method=full", "budget=8,16,null", f"results_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run,) = read_jsonl(str(out / "runs.jsonl"))
    assert run["budget"] is None and "_bnone_" in run["run_id"]
    assert proc.stdout.count("already finished") == 2
