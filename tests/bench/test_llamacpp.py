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


# ---------------------------------------------------------------------------------- the verdicts, both ways
def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_llamacpp", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _figures():
    return {"kvbench_b1_ctx512": 36.0, "kvbench_b1_ctx4096": 29.0, "kvbench_b1_ctx16384": 14.0,
            "kvbench_b16_ctx512": 240.0, "ratio_b1_ctx512": 1.15, "ratio_b1_ctx4096": 1.3,
            "ratio_b1_ctx16384": 1.2, "ratio_b16_ctx512": 1.6, "bandwidth_fraction_b1_ctx4096": 0.88}


def test_good_figures_pass_and_pass_again():
    bench = _bench()
    first = bench.target_checks(_figures(), [512, 4096, 16384])
    assert first == bench.target_checks(_figures(), [512, 4096, 16384])
    assert set(first) == {"b16_over_b1_ctx512_ge_6", "bandwidth_fraction_b1_ctx4096_ge_0.85",
                          "ahead_of_llamacpp_b1_ctx512", "ahead_of_llamacpp_b1_ctx4096",
                          "ahead_of_llamacpp_b1_ctx16384", "ahead_of_llamacpp_b16_ctx512"}
    assert all(first.values())


@pytest.mark.parametrize("key, bad, check", [
    ("kvbench_b16_ctx512", 210.0, "b16_over_b1_ctx512_ge_6"),  # 5.83x batch 1
    ("kvbench_b16_ctx512", float("nan"), "b16_over_b1_ctx512_ge_6"),
    ("kvbench_b1_ctx512", None, "b16_over_b1_ctx512_ge_6"),
    ("bandwidth_fraction_b1_ctx4096", 0.84, "bandwidth_fraction_b1_ctx4096_ge_0.85"),
    ("bandwidth_fraction_b1_ctx4096", float("nan"), "bandwidth_fraction_b1_ctx4096_ge_0.85"),
    ("ratio_b1_ctx16384", 0.98, "ahead_of_llamacpp_b1_ctx16384"),
    ("ratio_b1_ctx16384", 1.0, "ahead_of_llamacpp_b1_ctx16384"),  # a tie is not ahead
    ("ratio_b16_ctx512", float("nan"), "ahead_of_llamacpp_b16_ctx512"),
    ("ratio_b1_ctx512", "missing", "ahead_of_llamacpp_b1_ctx512"),  # llama.cpp failed: no ratio
])
def test_a_worse_missing_or_nan_figure_is_not_met(key, bad, check):
    figures = _figures()
    if bad == "missing":
        del figures[key]
    else:
        figures[key] = bad
    checks = _bench().target_checks(figures, [512, 4096, 16384])
    assert checks[check] is False
    assert all(ok for name, ok in checks.items() if name != check)
