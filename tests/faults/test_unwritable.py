"""An unwritable results folder (a regular file, a path under /dev/null or /proc, a read-only filesystem) is one
line on stderr and exit code 2, never a traceback."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.app.test_bad_input import cli  # noqa: F401  (the in-process CLI fixture)
from tests.harness_fakes import run_fake_cli
from tests.app.test_cli import assert_usage_error, kvbench


@pytest.mark.parametrize("where", ["file", "/dev/null/R", "/proc/kvbench-results"])
def test_unwritable_results_dir_in_process(cli, tmp_path, where):  # noqa: F811
    target = str(tmp_path / "a-file") if where == "file" else where
    if where == "file":
        (tmp_path / "a-file").write_text("x")
    code, out, err = cli(["logger.wandb=false", f"results_dir={target}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("kvbench: error: ") and target in lines[0] and "Traceback" not in out + err


def test_unwritable_results_dir_as_a_subprocess(tmp_path):
    (tmp_path / "a-file").write_text("x")
    proc = kvbench("-m", "budget=8,16", "method=h2o", "logger.wandb=false", f"results_dir={tmp_path / 'a-file'}",
                   cwd=tmp_path)
    assert_usage_error(proc, "a-file")


@pytest.fixture
def read_only_dir(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("a read-only mount needs root (file modes do not stop root)")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_read_only_filesystem(cli, read_only_dir):  # noqa: F811
    code, out, err = cli(["logger.wandb=false", f"results_dir={read_only_dir / 'r'}"])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Read-only file system" in lines[0], err


def test_rerun_into_a_folder_that_became_read_only(tmp_path):
    """A results folder that held a finished run and is now read-only (a remounted disk): one line, exit 2."""
    if os.geteuid() != 0:
        pytest.skip("remounting needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        first = run_fake_cli("budget=8", f"results_dir={mnt / 'r'}", cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        for args in (["budget=8", "rerun=true"], ["budget=8"], ["-m", "budget=8,16"]):
            proc = run_fake_cli(*args, f"results_dir={mnt / 'r'}", cwd=tmp_path)
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            assert proc.returncode == 2 and len(lines) == 1, (args, proc.stderr)
            assert "Read-only file system" in lines[0] and str(mnt / "r") in lines[0]
            assert "Traceback" not in proc.stdout + proc.stderr
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
