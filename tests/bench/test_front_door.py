"""The front door: `make bench-methods`' default set, and the install's announced steps."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "bench") not in sys.path:
    sys.path.append(str(REPO / "bench"))  # bench/bench_methods.py imports its neighbour bench/computed.py
_spec = importlib.util.spec_from_file_location("bench_methods", REPO / "bench" / "bench_methods.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_bench_methods_defaults_to_the_seed_methods_and_all_is_every_one():
    every = bench.eviction_methods()
    seed = bench.default_methods()
    assert seed == [n for n in bench.SEED_METHODS if n in every] and len(seed) >= 3
    assert len(every) > len(seed) and set(seed) < set(every)


def test_every_pip_install_of_make_is_announced_first():
    """`make -n install` (nothing run): each pip install comes after an `echo "kvbench install: ..."` line."""
    proc = subprocess.run(["make", "-n", "-B", "install-test", "VENV=/nonexistent-venv"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if "pip install" in line and "echo" not in line]
    assert len(installs) >= 3, proc.stdout
    for i in installs:
        before = "\n".join(lines[max(0, i - 3):i + 1])
        assert "kvbench install: " in before, before
