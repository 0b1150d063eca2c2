"""Shared fixtures: the packaged SmolLM2 (converted once into a stable cache dir) and thread limits."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from kvbench.store import faults

os.environ.setdefault("KVBENCH_CACHE_DIR", str(Path.home() / ".cache" / "kvbench"))
os.environ.setdefault("WANDB_MODE", "disabled")
# one thread: tests are small, and two OpenMP threads on a busy 2-core machine can run 40x slower
torch.set_num_threads(1)

# absl's logging handler (imported by rouge-score) holds the sys.stderr of the moment it was imported, and its
# close() closes that stream unless it is the sys.stderr/stdout of the moment of closing. Hydra's logging setup
# (logging.config.dictConfig) closes every handler. Imported while pytest's global capture was sys.stderr and closed
# during an in-process CLI test (capsys then holds sys.stderr), it closed pytest's capture file: every later test of
# that process errored ("I/O operation on closed file"). Its stream is set to the process's own stderr, which absl
# never closes (tests/app/test_capture_safety.py).
try:
    import absl.logging

    absl.logging.get_absl_handler().python_handler.stream = sys.__stderr__
except ImportError:
    pass

try:  # property tests draw the same examples on every run (CI must not depend on luck); HYPOTHESIS_PROFILE=default
    from hypothesis import settings  # explores new ones

    settings.register_profile("kvbench", derandomize=True, database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kvbench"))
except ImportError:
    pass


@pytest.fixture(scope="session")
def smollm2():
    """The packaged SmolLM2-135M-Instruct in the kvbench runtime, with its transformers model kept."""
    from kvbench.runtime.model.loading import load_model

    return load_model(keep_hf=True)


@pytest.fixture
def fault_points():
    """kvbench.store.faults for this test: install callbacks at its named points; all are removed afterwards."""
    faults.clear()
    yield faults
    faults.clear()
