"""`python -m kvbench` as typed: help, runs, reruns and sweeps from any directory (bad input, one line and exit 2:
tests/app/test_bad_input.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from tests.harness_fakes import CONF_DIR  # noqa: F401  (sets KVBENCH_CACHE_DIR for the subprocesses)
from kvbench.store.files import read_jsonl


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kvbench_env(**extra):
    """The environment of a `python -m kvbench` subprocess: this checkout first on sys.path (whatever the cwd)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for key in ("HYDRA_FULL_ERROR", "WANDB_API_KEY", "WANDB_MODE"):
        env.pop(key, None)
    return env


def kvbench(*args, cwd, timeout=300):
    env = kvbench_env()
    return subprocess.run([sys.executable, "-m", "kvbench", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_usage_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvbench: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_help_lists_each_group(tmp_path):
    proc = kvbench("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for line in ("method: full", "task: perplexity", "model: hf, smollm2-135m", "runtime: default",
                 "logger: none, wandb", "budget=N"):
        assert line in proc.stdout or line.split(":")[0] + ":" in proc.stdout, line
    assert "kvbench_schema" not in proc.stdout and "kvbench_task" not in proc.stdout
    assert not list(tmp_path.iterdir())  # --help writes nothing


def test_run_rerun_and_sweep_from_another_directory(tmp_path):
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    common = ["logger.wandb=false", "task.max_tokens=48", "task.chunk_size=8", "results_dir=out"]
    proc = kvbench("method=streaming_llm", "budget=32", *common, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert "kvbench run OK" in proc.stdout and "ppl" in proc.stdout
    out = cwd / "out"
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "ok" and metrics["budget"] == 32 and metrics["method"] == "streaming_llm"
    assert metrics["num_tokens"] == 47 and metrics["peak_kv_bytes"] > 0
    assert (run_dir / "config.yaml").exists() and (run_dir / "samples.jsonl").exists()
    assert (run_dir / ".hydra").is_dir()  # Hydra's files go inside the run folder...
    assert sorted(p.name for p in cwd.iterdir()) == ["out"]  # ...and nothing else lands in the cwd

    # a sweep over the finished run and a new one: the finished one is skipped (its stored summary is printed
    # again: tests/store/test_results.py), the new one runs
    sweep = kvbench("-m", "method=streaming_llm", "budget=16,32", *common, cwd=cwd)
    assert sweep.returncode == 0, sweep.stderr
    assert "skipping" in sweep.stdout
    runs = read_jsonl(str(out / "runs.jsonl"))
    assert [r["budget"] for r in runs] == [32, 16]  # budget=32 was finished already: skipped
    assert len([p for p in out.iterdir() if p.is_dir()]) == 2


def test_a_sweep_ends_with_one_table_of_its_runs(tmp_path):
    from tests.harness_fakes import run_fake_cli

    proc = run_fake_cli("-m", "method=h2o,full", "budget=8,16", "task.max_tokens=40,48", f"results_dir={tmp_path / 'r'}",
                        cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    boxes, table = proc.stdout.rsplit("kvbench run OK", 1)[0], proc.stdout.split("kvbench sweep:")[-1]
    assert "kvbench sweep: 6 runs" in proc.stdout and boxes  # after the per-run boxes (full ignores the budget)
    lines = table.splitlines()
    header = lines[1].split()
    assert header[:3] == ["method", "budget", "max_tokens"] and "ppl" in header and header[-2:] == ["saved", "status"]
    rows = [line.split() for line in lines[3:] if line and not line.startswith("=")]
    assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(
        [("full", "-", "40"), ("full", "-", "48"), ("h2o", "8", "40"), ("h2o", "8", "48"), ("h2o", "16", "40"),
         ("h2o", "16", "48")])
    assert all(r[-1] == "ok" for r in rows)
    assert "next      add method=" not in proc.stdout  # a sweep's table sets its runs side by side already


def test_a_single_run_prints_no_sweep_table(tmp_path):
    from tests.harness_fakes import run_fake_cli

    proc = run_fake_cli("method=full", f"results_dir={tmp_path / 'r'}", cwd=tmp_path)
    assert proc.returncode == 0 and "kvbench run OK" in proc.stdout and "kvbench sweep" not in proc.stdout
    # the default method (full) keeps every token: the summary ends with the overrides that compress the same run
    assert "next      add method=paged_eviction budget=" in proc.stdout, proc.stdout


def _copy_checkout(dest):
    """The checkout's files (tracked and new, as git lists them; links kept as links) copied into dest."""
    names = subprocess.run(["git", "-C", REPO, "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src, dst = os.path.join(REPO, name), os.path.join(dest, name)
        if not os.path.lexists(src):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def test_python_m_kvbench_from_the_folder_that_holds_a_checkout_named_kvbench(tmp_path):
    """A checkout in a folder named kvbench, installed editable (as `make install` does): `python -m kvbench` works
    from the folder that holds it, where Python first sees that folder as a namespace package `kvbench` (whose
    results/ folder shadowed kvbench.results: "cannot import name 'model_label'")."""
    parent = tmp_path / "work"
    checkout = parent / "kvbench"
    _copy_checkout(checkout)
    (checkout / "results").mkdir(exist_ok=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True,
                          text=True, check=True).stdout.strip()
    # this interpreter's site-packages (pip among them), also when its venv sits inside the checkout (.venv of a
    # fresh clone); a directory added by a .pth has its own .pth files ignored, so its editable kvbench is not seen
    deps = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "zz_kvbench_test_deps.pth"), "w") as f:  # this interpreter's packages, last
        f.write("\n".join(deps) + "\n")
    install = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                              "-e", str(checkout)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    env = {k: v for k, v in kvbench_env().items() if k != "PYTHONPATH"}
    # from the folder that holds the checkout: where `kvbench` resolved to the namespace package
    proc = subprocess.run([py, "-m", "kvbench", "--help"], cwd=parent, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Usage: python -m kvbench" in proc.stdout, proc.stderr[-2000:]
    where = subprocess.run([py, "-c", "import kvbench.methods, kvbench.store.naming as r; r.model_label; "
                            "print(kvbench.methods.__file__)"], cwd=parent, env=env, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    assert os.path.realpath(where.stdout.strip()) == str(checkout / "methods" / "__init__.py")
