"""An in-process CLI run after absl's logging was imported (rouge-score imports it) leaves pytest's capture open:
absl's handler closes the stream it was created with when Hydra's logging setup closes every handler
(tests/conftest.py points it at the process's own stderr)."""
from __future__ import annotations

import sys

import absl.logging

from tests.test_bad_input import cli  # noqa: F401  (the in-process CLI fixture)


def test_absl_handler_writes_to_the_process_stderr():
    assert absl.logging.get_absl_handler().python_handler.stream is sys.__stderr__


def test_a_hydra_run_in_process_leaves_the_capture_streams_open(cli):  # noqa: F811
    before = absl.logging.get_absl_handler().python_handler.stream
    code, out, err = cli(["logger.wandb=false", "results_dir=/dev/null/R"])  # reaches Hydra's logging setup
    assert code == 2 and "/dev/null/R" in err
    assert not before.closed and not sys.stdout.closed and not sys.stderr.closed
