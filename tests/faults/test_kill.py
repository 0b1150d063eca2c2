"""kill -9 mid-run and between metrics.json and the runs.jsonl line, then a rerun: every run recorded exactly once.
Real subprocesses of the CLI over fake models (tests.harness_fakes), so a run costs the interpreter start only."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from tests import fault_cli
from tests.harness_fakes import run_fake_cli, wait_for_lines
from kvbench.run import exit_channel
from kvbench.store.files import read_jsonl
from kvbench.store.folder import RunFolder, repair_index
from kvbench.store.runs import load_runs
from kvbench.store.table import runs_frame


def _index(out):
    return read_jsonl(str(out / "runs.jsonl"))


def test_kill_9_mid_run_then_rerun(tmp_path):
    out, marker = tmp_path / "r", tmp_path / "marker"
    sweep = ["-m", "budget=8,16", f"results_dir={out}"]
    proc = fault_cli.start(*sweep, cwd=tmp_path, sleep_before_task=60, marker=marker)
    wait_for_lines(marker, 1, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    (killed,) = [p for p in out.iterdir() if p.is_dir()]
    assert (killed / "config.yaml").exists() and not (killed / "metrics.json").exists()  # never looks finished
    assert _index(out) == []

    again = run_fake_cli(*sweep, cwd=tmp_path)  # the dead worker's claim is taken over
    assert again.returncode == 0, again.stderr
    runs = _index(out)
    assert sorted(r["budget"] for r in runs) == [8, 16] and {r["status"] for r in runs} == {"ok"}
    assert len({r["run_id"] for r in runs}) == 2
    assert json.loads((killed / "metrics.json").read_text())["status"] == "ok"


def test_kill_between_metrics_and_index_is_repaired(tmp_path):
    out = tmp_path / "r"
    crashed = fault_cli.run("budget=8", f"results_dir={out}", cwd=tmp_path, exit_before_index=9)
    assert crashed.returncode == 9
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "ok"
    assert _index(out) == []  # the folder finished, the index does not know yet

    # the next run into the folder (here a repeat of the same config) repairs the index, and skips the run
    again = run_fake_cli("budget=8", f"results_dir={out}", cwd=tmp_path)
    assert again.returncode == 0 and "already finished" in again.stdout, again.stderr
    runs = _index(out)
    assert [r["run_id"] for r in runs] == [run_dir.name]  # once


def test_load_runs_repairs_the_index_too(tmp_path):
    folder = RunFolder(str(tmp_path), "r1")
    folder.start("a: 1\n")
    folder.write_metrics({"run_id": "r1", "status": "ok", "attempt_id": "x1"})  # killed before the index line
    assert _index(tmp_path) == []
    df = runs_frame(load_runs(str(tmp_path)))
    assert list(df["run_id"]) == ["r1"]
    assert [r["attempt_id"] for r in _index(tmp_path)] == ["x1"]
    load_runs(str(tmp_path))
    assert len(_index(tmp_path)) == 1  # repair never duplicates


def test_a_fault_between_metrics_and_index_leaves_the_folder_finished(tmp_path, fault_points):
    """The same cut in-process, through the `fault_points` fixture: metrics.json is written, the line is not."""
    folder = RunFolder(str(tmp_path), "r1")
    folder.start("a: 1\n")

    def cut():
        raise KeyboardInterrupt

    fault_points.install("before_index", cut)
    with pytest.raises(KeyboardInterrupt):
        folder.finish({"run_id": "r1", "status": "ok", "attempt_id": "x1"})
    assert folder.finished() and _index(tmp_path) == []
    fault_points.clear()
    assert repair_index(str(tmp_path)) == 1 and [r["attempt_id"] for r in _index(tmp_path)] == ["x1"]


def test_kill_9_leaves_no_exit_channel_file(tmp_path):
    """The channel the launcher workers report through has no name on Linux: a killed CLI leaves nothing in TMPDIR."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out, marker = tmp_path / "r", tmp_path / "marker"
    proc = fault_cli.start("-m", "budget=8,16", f"results_dir={out}", cwd=tmp_path, TMPDIR=str(tmp),
                           sleep_before_task=60, marker=marker)
    wait_for_lines(marker, 1, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert [p.name for p in tmp.iterdir() if p.name.startswith("kvbench-exit-")] == []


def test_named_channels_of_dead_processes_are_removed(tmp_path, monkeypatch):
    """Without O_TMPFILE the channel is a named file: the next CLI deletes those whose process is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    monkeypatch.delenv(exit_channel.EXIT_FILE_ENV, raising=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"kvbench-exit-{dead.stdout.strip()}-abc"
    live = tmp_path / f"kvbench-exit-{os.getppid()}-abc"
    stale.write_text("1\t\n")
    live.write_text("")
    exit_channel.open_exit_channel()
    try:
        path = os.environ[exit_channel.EXIT_FILE_ENV]
        assert not stale.exists() and live.exists() and os.path.dirname(path) == str(tmp_path)
        exit_channel.note_exit(2, "/some/run")
        assert exit_channel.exit_code() == 2 and exit_channel.sweep_runs() == ["/some/run"]
    finally:
        exit_channel.close_exit_channel()
        monkeypatch.setattr(exit_channel, "_exit_code", 0)
    assert not os.path.exists(path)
