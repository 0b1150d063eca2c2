"""bench/bench_llamacpp.py's front door: without llama.cpp it skips in one line; a bad argument exits 2 in one line."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_llamacpp.py"


def _run(*args):
    env = dict(os.environ, PYTHONPATH=str(BENCH.parents[1] / "src"))
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env, timeout=120)


def test_skips_in_one_line_without_llamacpp():
    pytest.importorskip("torch")
    try:
        import llama_cpp  # noqa: F401
        pytest.skip("llama_cpp installed here: the bench would run")
    except ImportError:
        pass
    proc = _run()
    assert proc.returncode == 0
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped" in lines[0] and "--llamacpp-python" in lines[0]


@pytest.mark.parametrize("args, word", [(["--contexts", "512,abc"], "--contexts"),
                                        (["--llamacpp-python", "/nonexistent/python"], "--llamacpp-python")])
def test_bad_input_exits_2_in_one_line(args, word):
    proc = _run(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and word in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
