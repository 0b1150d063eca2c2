"""Issue 56, item 8: an integral float given to an integer setting (`budget=64.0`, `budget=1e3`,
`runtime.speculative.num_tokens=4.0`) is that integer, as docs/configuration.md promises: the same run id as the
integer spelling, and the same run. The refusals (too large, out of bounds) are rows of test_bad_input.py."""
from __future__ import annotations

import pytest

from kvbench.run.config import int_keys
from kvbench.errors import UserError
from kvbench.run.spec import integral_spellings
from tests.harness_fakes import run_fake_cli


def test_overrides_of_integer_settings_are_spelled_as_integers():
    keys = int_keys()
    assert {"budget", "seed", "runtime.block_size", "runtime.speculative.num_tokens"} <= keys
    assert integral_spellings(["budget=64.0", "+runtime.block_size=1.6e1", "seed=3", "task.max_tokens=64.0",
                               "model.name=1e3", "runtime.speculative.num_tokens=4.0", "budget=1.5"], keys) == [
        "budget=64", "+runtime.block_size=16", "seed=3", "task.max_tokens=64.0", "model.name=1e3",
        "runtime.speculative.num_tokens=4", "budget=1.5"]  # 1.5 is left to the check that refuses it
    assert integral_spellings(["budget=64.0,128,2.56e2"], keys) == ["budget=64,128,256"]
    with pytest.raises(UserError, match=r"invalid budget=1e\+20: too large"):
        integral_spellings(["budget=1e20"], keys)


def test_budget_as_a_float_is_the_integer_run(tmp_path):
    out = tmp_path / "r"
    first = run_fake_cli("budget=64", "task.max_tokens=80", f"results_dir={out}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_fake_cli("budget=6.4e1", "task.max_tokens=80", f"results_dir={out}", cwd=tmp_path)
    assert again.returncode == 0 and "already finished" in again.stdout, (again.stdout, again.stderr)
