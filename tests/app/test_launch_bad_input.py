"""Issue 56, item 8: under torchrun every rank checks the same config, so bad input is one line from rank 0 and
exit 2 on every rank (it was a line per rank); ranks other than 0 exit 2 quietly. (torchrun's own summary of its
children's exit codes is torchrun's.)"""
from __future__ import annotations

import subprocess
import sys

from tests.app.test_cli import REPO, assert_usage_error, kvbench_env


def _rank(rank: int, tmp_path, *args):
    env = kvbench_env(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    return subprocess.run([sys.executable, "-m", "kvbench", *args, "logger=none", f"results_dir={tmp_path / 'r'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_bad_input_in_a_launch_is_one_line_from_rank_0(tmp_path):
    for args in (["budget=-5"], ["method=nope"]):  # refused by kvbench's checks, and by Hydra's composition
        lead = _rank(0, tmp_path, *args)
        assert_usage_error(lead, args[0].split("=")[0])
        follower = _rank(1, tmp_path, *args)
        assert follower.returncode == 2 and follower.stderr.strip() == "", follower.stderr
        assert "Traceback" not in follower.stdout + follower.stderr
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").glob("*/metrics.json"))
