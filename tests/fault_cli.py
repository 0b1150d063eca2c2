"""The fake CLI (tests.harness_fakes) with faults injected at kvbench.store.faults' named points, for the fault tests
that kill, signal or race real subprocesses.

    python -m tests.fault_cli [--sleep-before-task=S] [--sleep-skip=K] [--marker=PATH] [--exit-before-index=CODE]
                              HYDRA_ARGS

--sleep-before-task  each run sleeps S seconds once its model is loaded, before the task (after appending its pid to
                     --marker, so a test knows the run got there: wait_for_lines). The sleep wakes every 20 ms, so a
                     signal is acted on at once even when the kernel delivered it to another thread (the claim's
                     heartbeat) and the main thread's sleep would not have been interrupted
--sleep-skip         the first K runs of the process write their marker line and go on without sleeping (a sweep
                     whose first runs finish and whose next one waits for the test's signal)
--exit-before-index  the process exits with CODE (os._exit: no cleanup, as kill -9) between metrics.json and the
                     run's runs.jsonl line
The faults are installed in this process before the CLI starts (launcher workers in other processes get none).
SIGINT is handled as Ctrl-C (KeyboardInterrupt) even when the test runner was started with it ignored (a shell's
background job): the tests send it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, Optional

from kvbench.store import faults
from tests.harness_fakes import FAKE_ARGS, fake_cli, fake_env

FLAGS = ("--sleep-before-task=", "--marker=", "--exit-before-index=", "--sleep-skip=")


def fault_flags(sleep_before_task: Optional[float] = None, marker: Any = None,
                exit_before_index: Optional[int] = None, sleep_skip: Optional[int] = None) -> list[str]:
    """The command-line flags of the given faults."""
    values = (sleep_before_task, marker, exit_before_index, sleep_skip)
    return [f"{flag}{value}" for flag, value in zip(FLAGS, values) if value is not None]


def install(argv: list[str]) -> list[str]:
    """Install the faults named by the leading fault flags of argv; returns the arguments left (Hydra's)."""
    opts: dict = {}
    rest = list(argv)
    while rest and rest[0].startswith(FLAGS):
        key, _, value = rest.pop(0)[2:].partition("=")
        opts[key] = value
    if "sleep-before-task" in opts:
        delay, marker = float(opts["sleep-before-task"]), opts.get("marker")
        skip = [int(opts.get("sleep-skip", 0))]

        def sleep() -> None:
            if marker:
                with open(marker, "a") as f:
                    f.write(f"{os.getpid()}\n")
            if skip[0] > 0:
                skip[0] -= 1
                return
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:
                time.sleep(0.02)

        faults.install("before_task", sleep)
    if "exit-before-index" in opts:
        code = int(opts["exit-before-index"])
        faults.install("before_index", lambda: os._exit(code))
    return rest


def start(*args: str, cwd: Any, sleep_before_task: Optional[float] = None, marker: Any = None,
          exit_before_index: Optional[int] = None, sleep_skip: Optional[int] = None, **env_extra: str) -> Any:
    """Popen of the fake CLI with these faults (stdout and stderr captured as text); args as for start_fake."""
    flags = [a for a in args if a.startswith("-")]  # Hydra's flags (-m) before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    cmd = [sys.executable, "-m", "tests.fault_cli", *fault_flags(sleep_before_task, marker, exit_before_index, sleep_skip),
           *flags, *FAKE_ARGS, *overrides]
    return subprocess.Popen(cmd, cwd=str(cwd), env=fake_env(**env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(*args: str, cwd: Any, timeout: float = 120, **kwargs: Any) -> Any:
    """Run the fake CLI with these faults to the end: returncode, stdout, stderr."""
    proc = start(*args, cwd=cwd, **kwargs)
    out, err = proc.communicate(timeout=timeout)
    return SimpleNamespace(returncode=proc.returncode, stdout=out, stderr=err)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv[1:] = install(sys.argv[1:])
    fake_cli()
