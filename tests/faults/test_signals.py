"""SIGINT and SIGTERM (what a cluster scheduler sends) in the middle of a sweep: the run is recorded as failed with
error "interrupted" / "terminated", the sweep stops, and the exit code is non-zero (130 / 143).

Each test waits for the child's marker line (written at the before_task fault point, tests/fault_cli.py) before it
signals, and the child then sleeps far longer than any test waits: what the test sees does not depend on how fast a
loaded machine runs it. The timeouts are only safety nets (a hung child is killed and the test fails with its
output)."""
from __future__ import annotations

import json
import signal

import pytest

from tests import fault_cli
from tests.harness_fakes import wait_for_lines
from kvbench.store.files import read_jsonl

SAFETY_TIMEOUT_S = 180  # a child that does not end after the signal fails the test (never reached when it works)
SLEEP_S = 3600  # the fault's sleep: the signal always arrives during it


def _communicate(proc):
    """(stdout, stderr) of a signalled child; a child still running after SAFETY_TIMEOUT_S is killed: failure."""
    import subprocess

    try:
        return proc.communicate(timeout=SAFETY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child did not end {SAFETY_TIMEOUT_S} s after the signal:\n{out}\n{err}")


@pytest.mark.parametrize("sig,error,code", [(signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "terminated", 143)])
def test_signal_mid_sweep_is_recorded(tmp_path, sig, error, code):
    out, marker = tmp_path / "r", tmp_path / "marker"
    proc = fault_cli.start("-m", "budget=8,16", f"results_dir={out}", cwd=tmp_path, sleep_before_task=SLEEP_S,
                           marker=marker)
    wait_for_lines(marker, 1, proc)
    proc.send_signal(sig)
    _, err = _communicate(proc)
    assert proc.returncode == code, err
    assert f"kvbench: error: {error}" in err and "Traceback" not in err
    (run_dir,) = [p for p in out.iterdir() if p.is_dir()]  # the sweep stopped: the second run never started
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"] == error and metrics["wall_s"] > 0
    (line,) = read_jsonl(str(out / "runs.jsonl"))
    assert line["error"] == error and line["attempt_id"] == metrics["attempt_id"]


SECOND_SIGTERM = """
import os, signal, time
from kvbench.commands.cli import install_sigterm_handler
from kvbench.errors import Terminated
install_sigterm_handler()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except Terminated:
    os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while the first is being handled (cleanup, atexit)
    time.sleep(5)
print("not reached")
"""


def test_a_second_sigterm_while_the_first_is_handled_exits_at_once_without_a_traceback():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", SECOND_SIGTERM], capture_output=True, text=True,
                          timeout=SAFETY_TIMEOUT_S)
    assert proc.returncode == 143 and "not reached" not in proc.stdout
    assert proc.stderr.strip() == "kvbench: error: terminated again: exiting now", proc.stderr


@pytest.mark.parametrize("gap_s", [0.0, pytest.param(0.005, marks=pytest.mark.slow),
                                   pytest.param(0.01, marks=pytest.mark.slow),
                                   pytest.param(0.02, marks=pytest.mark.slow), 0.05])
def test_two_sigterms_mid_run_print_no_traceback(tmp_path, gap_s):
    import time

    out, marker = tmp_path / "r", tmp_path / "marker"
    proc = fault_cli.start("budget=8", f"results_dir={out}", cwd=tmp_path, sleep_before_task=SLEEP_S, marker=marker)
    wait_for_lines(marker, 1, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(gap_s)  # the gap between the two signals (what is tested), not a wait for the child
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = _communicate(proc)
    # 143; or killed by the signal itself (-15, 143 to a shell) when it came as the interpreter was shutting down
    assert proc.returncode in (143, -signal.SIGTERM) and "Traceback" not in err, err
    assert "kvbench: error: terminated" in err


def test_an_interrupted_sweep_prints_the_table_of_the_runs_that_finished(tmp_path):
    out, marker = tmp_path / "r", tmp_path / "marker"
    # the first run goes through its fault point without sleeping and finishes; the second sleeps until signalled
    proc = fault_cli.start("-m", "budget=8,16,24", f"results_dir={out}", cwd=tmp_path, sleep_before_task=SLEEP_S,
                           sleep_skip=1, marker=marker)
    wait_for_lines(marker, 2, proc)  # the first run finished, the second is in its sleep
    proc.send_signal(signal.SIGINT)
    stdout, err = _communicate(proc)
    assert proc.returncode == 130 and "kvbench: error: interrupted" in err, err
    table = stdout.split("the sweep stopped; the 1 run(s) that finished before:")[1]
    assert "kvbench sweep: 1 runs" in table
    rows = [line.split() for line in table.splitlines() if line.startswith("h2o")]
    assert len(rows) == 1 and rows[0][1] == "8" and rows[0][-1] == "ok", table
