"""Quest on the packaged model (slow: 4,096-token needle runs through the CLI, depths 0, 50 and 100 %): full attention
finds the needle at every depth; quest at budget 2,048 does too, reading about two thirds of the K/V; at budget 512
(the issue's target) it does not on this 135M model: measured, it found the needle at depth 100 only (accuracy 1/3;
budget 1,024 found it at depth 50, not 0): a strict xfail, so the day it passes the test says so. The official
selection itself does the same on these prompts: bench/quest_reference_needle.py, Quest's evaluation code
transcribed into a transformers attention function, found the needle at depth 100 only at budget 512, with its
per-head rule and with the union rule alike, while transformers' eager attention alone finds it at depth 0. The
answer is fragile on this model: with a budget covering the context, the official code's clamp (one chunk of 260
dropped per head) already loses depths 0 and 50."""
from __future__ import annotations

import json
import os

import pytest

from tests.app.test_cli import kvbench


def _needle(tmp_path, *method):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = kvbench(*method, "task=needle", "task.lengths=[4096]", "task.depths=[0,50,100]", f"results_dir={tmp_path}",
                   "progress=false", "logger.mode=disabled", cwd=str(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = [d for d in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, d))]
    (run,) = runs
    with open(os.path.join(tmp_path, run, "metrics.json")) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [2048, pytest.param(512, marks=pytest.mark.xfail(
    strict=True, reason="SmolLM2-135M: quest@512 finds the 4,096-token needle at depth 100 only (measured 1/3), "
           "as the official selection transcribed over transformers does (bench/quest_reference_needle.py)"))])
def test_needle_at_4096_found_by_quest_where_full_finds_it(tmp_path, budget):
    full = _needle(tmp_path / "full", "method=full")
    quest = _needle(tmp_path / "quest", "method=quest", f"budget={budget}")
    assert full["accuracy"] == 1.0
    assert quest["kv_read_fraction"] < 0.75 < full["kv_read_fraction"]
    assert quest["peak_kv_bytes"] > full["peak_kv_bytes"]  # nothing evicted; the summaries are resident too
    assert quest["accuracy"] == 1.0
