"""Quest on the packaged model (slow: two 4,096-token needle runs through the CLI): the needle at 4,096 tokens is
found at budget 512 (an eighth of the context read per decode step) where full attention finds it, and the run
records what it read."""
from __future__ import annotations

import json
import os

import pytest

from tests.app.test_cli import kvbench


def _needle(tmp_path, *method):
    proc = kvbench(*method, "task=needle", "task.lengths=[4096]", "task.depths=[50]", f"results_dir={tmp_path}",
                   "progress=false", "logger.mode=disabled", cwd=str(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = [d for d in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, d))]
    (run,) = runs
    with open(os.path.join(tmp_path, run, "metrics.json")) as f:
        return json.load(f)


@pytest.mark.slow
def test_needle_at_4096_found_at_budget_512(tmp_path):
    full = _needle(tmp_path / "full", "method=full")
    quest = _needle(tmp_path / "quest", "method=quest", "budget=512")
    assert full["accuracy"] == 1.0
    assert quest["accuracy"] == 1.0
    assert quest["kv_read_fraction"] < 0.6 < full["kv_read_fraction"]
    assert quest["peak_kv_bytes"] > full["peak_kv_bytes"]  # nothing evicted; the summaries are resident too
