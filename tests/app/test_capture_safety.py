"""absl's logging handler (rouge-score imports absl) closes the stream it was created with when Hydra's logging setup
closes every handler; created under pytest's capture, that stream was pytest's capture file. tests/conftest.py
points it at the process's own stderr, which absl never closes."""
from __future__ import annotations

import sys

import absl.logging


def test_absl_handler_writes_to_the_process_stderr():
    assert absl.logging.get_absl_handler().python_handler.stream is sys.__stderr__
