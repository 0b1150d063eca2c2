"""Issue 56, item 8: under a launch, bad input is one line and exit 2 before any worker starts. `kvbench-torchrun`
checks the config (every sweep job) in one process with the launch's WORLD_SIZE, then hands over to torchrun;
plain `torchrun -m kvbench` cannot do this (torchrun turns a worker's exit 2 into its ChildFailedError, exit 1)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbench.commands import torchrun
from tests.harness_fakes import CONF_DIR  # noqa: F401  (sets KVBENCH_CACHE_DIR)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_arguments_split_at_the_first_override():
    assert torchrun.split_args(["--nproc-per-node", "2", "method=snapkv", "budget=64"]) == (
        ["--nproc-per-node", "2"], ["method=snapkv", "budget=64"])
    assert torchrun.split_args(["--nnodes=1", "--standalone", "-m", "budget=64,128"]) == (
        ["--nnodes=1", "--standalone"], ["-m", "budget=64,128"])
    assert torchrun.split_args(["--nproc-per-node", "2", "--", "--help"]) == (["--nproc-per-node", "2"], ["--help"])
    assert torchrun.split_args(["--nproc-per-node", "2"]) == (["--nproc-per-node", "2"], [])


def test_the_launch_size_is_torchruns():
    assert torchrun.launch_world_size(["--nproc-per-node", "4"]) == 4
    assert torchrun.launch_world_size(["--nproc_per_node=2", "--nnodes", "3"]) == 6
    assert torchrun.launch_world_size(["--nproc-per-node", "2", "--nnodes=2:4"]) == 4
    assert torchrun.launch_world_size([]) == 1
    assert torchrun.launch_world_size(["--nproc-per-node", "cpu"]) == (os.cpu_count() or 1)


def test_the_workers_run_kvbench_under_torchrun():
    argv = torchrun.torchrun_argv(["--nproc-per-node", "2"], ["budget=64"])
    assert argv == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "kvbench",
                    "budget=64"]


def _launch(*args, tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HYDRA_FULL_ERROR", None)  # set by in-process CLI tests (kvbench.commands.cli.run_cli); a user's choice here
    return subprocess.run([sys.executable, "-m", "kvbench.commands.torchrun", *args, f"results_dir={tmp_path}/res"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


@pytest.mark.parametrize("args, line", [
    (["--nproc-per-node", "2", "budget=abc"], "kvbench: error: invalid budget='abc'"),
    # the launch's size reaches the check: a TP larger than the launch is refused before torchrun starts
    (["--nproc-per-node", "2", "runtime.tensor_parallel=4"],
     "kvbench: error: invalid runtime.tensor_parallel=4: larger than the 2 process(es) of this launch"),
    (["--nproc-per-node", "2", "-m", "budget=64,abc"], "kvbench: error: invalid budget='abc'"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_worker(args, line, tmp_path):
    proc = _launch(*args, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert not os.path.exists(tmp_path / "res")  # nothing written
    assert not [p for p in os.listdir(tmp_path) if p != "res"]  # no Hydra folder left in the working folder


def test_a_good_config_is_checked_then_handed_to_torchrun(monkeypatch, tmp_path):
    """The check passes (exit 0, nothing run or written) and the launch execs torchrun with kvbench's args."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    launched = []
    monkeypatch.setattr(torchrun.os, "execv", lambda path, argv: launched.append(argv))
    torchrun.main(["--nproc-per-node", "2", "runtime.tensor_parallel=1", "budget=64", f"results_dir={tmp_path}/r"])
    assert launched == [torchrun.torchrun_argv(["--nproc-per-node", "2"],
                                               ["runtime.tensor_parallel=1", "budget=64", f"results_dir={tmp_path}/r"])]
    # the check only made the results folder (its writability is checked), left empty for the launch to fill
    assert os.listdir(tmp_path / "r") == [] and os.listdir(tmp_path) == ["r"]


TORCHRUN_ARG_CASES = [  # issue 68, item 8: these ended in torchrun's traceback
    (["--nproc-per-node", "abc"], "invalid --nproc-per-node 'abc': expected an integer >= 1 or one of auto, cpu"),
    (["--nproc-per-node", "0"], "invalid --nproc-per-node '0'"),
    (["--nproc_per_node=-1"], "invalid --nproc-per-node '-1'"),
    (["--nnodes", "x:y"], "invalid --nnodes 'x:y': expected N or MIN:MAX"),
    (["--nnodes=3:2"], "invalid --nnodes '3:2'"),
    (["--nnodes", "1:2:3"], "invalid --nnodes '1:2:3'"),
    (["--nnodes", "0"], "invalid --nnodes '0'"),
    (["--nproc-per-node"], "--nproc-per-node needs a value"),
]


@pytest.mark.parametrize("args,line", TORCHRUN_ARG_CASES, ids=[" ".join(c[0]) for c in TORCHRUN_ARG_CASES])
def test_bad_torchrun_arguments_are_one_line_and_exit_2(args, line, monkeypatch, capsys):
    def no_check(*a, **k):
        raise AssertionError("the config was checked (a process started) for bad torchrun arguments")

    monkeypatch.setattr(torchrun, "check_launch", no_check)
    monkeypatch.setattr(torchrun.os, "execv", no_check)
    with pytest.raises(SystemExit) as info:
        torchrun.main([*args, "budget=64"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("kvbench-torchrun: error: "), err
    assert line in lines[0], (line, lines[0])


def test_good_torchrun_arguments_pass():
    for args in (["--nproc-per-node", "2"], ["--nproc_per_node=gpu", "--nnodes=1:4"], ["--nnodes", "2"], []):
        assert torchrun.check_torchrun_args(args) is None, args
