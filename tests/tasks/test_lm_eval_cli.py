"""`lm_eval --model kvbench ... --tasks kvbench_essays_mc` through lm-eval's own console script, with no
--include_path: kvbench-lm-eval.pth (kvbench/commands/lm_eval_hook.py) registers the model and the packaged tasks.

The console script runs in a scratch virtual environment that sees this environment's packages (a path line) and
this checkout (PYTHONPATH), with kvbench-lm-eval.pth in its site-packages where an install puts it; the shared
environment is left as it is."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from tests.harness_fakes import CONF_DIR  # noqa: E402,F401  (sets KVBENCH_CACHE_DIR for the subprocesses)
from kvbench.commands import lm_eval_hook  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PTH = REPO / lm_eval_hook.PTH_FILE
LM_EVAL_SCRIPT = Path(sysconfig.get_path("scripts")) / "lm_eval"
ARGS = ["--model", "kvbench", "--model_args", "method=streaming_llm,budget=64", "--tasks", "kvbench_essays_mc",
        "--limit", "4", "--device", "cpu"]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for key in ("HYDRA_FULL_ERROR", "WANDB_API_KEY"):
        env.pop(key, None)
    return env


def _scratch_venv(where: Path, with_pth: bool) -> Path:
    """A virtual environment whose site-packages holds a path line to this environment's packages (so lm-eval,
    torch, ... import; the .pth files there are not run) and, with_pth, kvbench-lm-eval.pth; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "0-test-environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    if with_pth:
        Path(site, lm_eval_hook.PTH_FILE).write_text(PTH.read_text())
    return python


def test_the_pth_file_is_the_hooks_line():
    assert PTH.read_text() == lm_eval_hook.pth_line()


def test_wheels_carry_the_pth(tmp_path):
    """setup.py puts kvbench-lm-eval.pth at the root of the regular wheel and of the editable one (pip install -e)."""
    src = tmp_path / "checkout"
    (src / "src").mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md", lm_eval_hook.PTH_FILE):
        (src / name).write_bytes((REPO / name).read_bytes())
    (src / "src" / "kvbench").symlink_to(REPO / "kvbench")
    out = tmp_path / "wheels"
    out.mkdir()
    for build in ("build_editable", "build_wheel"):  # one process each: setuptools builds once per process
        code = f"import setuptools.build_meta as b, sys; b.{build}(sys.argv[1])"
        done = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 2 and any("editable" in w.name for w in wheels), wheels
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            assert z.read(lm_eval_hook.PTH_FILE).decode() == PTH.read_text(), wheel.name


def test_lm_eval_console_script_finds_kvbench_and_its_tasks(tmp_path):
    # without the .pth, lm-eval 0.4.13 knows neither the task nor the model (the check can fail)
    bare = _scratch_venv(tmp_path / "bare", with_pth=False)
    refused = subprocess.run([str(bare), str(LM_EVAL_SCRIPT), *ARGS], capture_output=True, text=True,
                             env=_env(), cwd=tmp_path, timeout=600)
    assert refused.returncode != 0 and "Tasks not found: kvbench_essays_mc" in refused.stderr, refused.stderr[-2000:]

    python = _scratch_venv(tmp_path / "venv", with_pth=True)
    out = tmp_path / "out"
    done = subprocess.run([str(python), str(LM_EVAL_SCRIPT), *ARGS, "--output_path", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    [path] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)
    task = results["results"]["kvbench_essays_mc"]
    for metric in ("acc", "acc_norm"):
        assert 0.0 <= task[f"{metric},none"] <= 1.0
        assert isinstance(task[f"{metric}_stderr,none"], float) and task[f"{metric}_stderr,none"] >= 0.0
    assert results["n-samples"]["kvbench_essays_mc"]["effective"] == 4
    assert results["config"]["model"] == "kvbench"
    assert results["config"]["model_args"] == {"method": "streaming_llm", "budget": 64}
    assert "kvbench_essays_mc" in done.stdout and "acc" in done.stdout  # lm-eval's table, stderr column included
