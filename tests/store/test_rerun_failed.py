"""A run whose last attempt failed is run again by the next command (a sweep rerun), and says so: one line naming
the run and the error it failed with; a run that never failed, or that finished, prints no such line."""
from __future__ import annotations

from kvbench.store.files import read_jsonl
from tests.store.test_results import run_fake


def test_a_failed_run_is_retried_with_a_line_saying_so(tmp_path, capsys):
    first = run_fake(tmp_path, fail=RuntimeError("the disk was unplugged"))
    assert first["status"] == "failed"
    assert "failed before" not in capsys.readouterr().out  # a first attempt is not a retry
    second = run_fake(tmp_path, fail=RuntimeError("again"))
    out = capsys.readouterr().out
    line = [line for line in out.splitlines() if "failed before" in line]
    assert len(line) == 1, out
    assert first["run_id"] in line[0] and "RuntimeError: the disk was unplugged" in line[0]
    assert "running it again" in line[0]
    assert second["status"] == "failed"
    third = run_fake(tmp_path)  # the retry that works: named as a retry of the second failure
    out = capsys.readouterr().out
    assert "failed before (RuntimeError: again" in out and third["status"] == "ok"
    assert [r["status"] for r in read_jsonl(str(tmp_path / "runs.jsonl"))] == ["failed", "failed", "ok"]
    run_fake(tmp_path)  # finished: skipped, no retry line
    assert "failed before" not in capsys.readouterr().out
