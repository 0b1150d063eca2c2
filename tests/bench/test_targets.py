"""The serving bench's verdicts (bench/bench_throughput.py::target_checks): both ways. The same figures judged twice
give the same verdicts; a missing row, a None or NaN ratio, or a figure past its target is NOT met."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "bench_throughput", Path(__file__).resolve().parents[2] / "bench" / "bench_throughput.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _row(throughput=1.0, running=1.0, tpot=1.0, **extra):
    return {"throughput_ratio_vs_full": throughput, "max_running_ratio_vs_full": running,
            "tpot_ratio_vs_full": tpot, **extra}


def _passing():
    return {"full": _row(), "full+pc": _row(tpot=1.4, prefix_caching_ratio=2.3),
            "paged_eviction": _row(1.6, 4.0, 1.4), "kivi2": _row(1.35, 4.0, 1.2),
            "paged_eviction@4": _row(1.1, 1.3, 9.0)}  # a sweep row is not judged against the TPOT target


def test_good_figures_pass_and_pass_again():
    first = bench.target_checks("prefill_heavy", _passing(), shared_prefix_pair=True)
    assert first == bench.target_checks("prefill_heavy", _passing(), shared_prefix_pair=True)
    assert first and all(first.values())
    assert set(first) == {"full_prefix_caching_ge_2x", "paged_eviction_throughput_ge_1.5x",
                          "kivi2_throughput_ge_1.3x", "every_tpot_p50_within_1.5x_of_full"}


@pytest.mark.parametrize("row,key,bad", [
    ("paged_eviction", "throughput_ratio_vs_full", 1.49), ("paged_eviction", "throughput_ratio_vs_full", None),
    ("paged_eviction", "throughput_ratio_vs_full", math.nan), ("kivi2", "throughput_ratio_vs_full", 1.2),
    ("kivi2", "tpot_ratio_vs_full", 1.51), ("kivi2", "tpot_ratio_vs_full", None),
    ("kivi2", "tpot_ratio_vs_full", math.nan), ("full+pc", "prefix_caching_ratio", 1.99),
    ("full+pc", "prefix_caching_ratio", None), ("full+pc", "prefix_caching_ratio", math.nan),
])
def test_a_worse_missing_or_nan_figure_fails(row, key, bad):
    summary = _passing()
    summary[row][key] = bad
    assert not all(bench.target_checks("prefill_heavy", summary, shared_prefix_pair=True).values())


def test_a_missing_prefix_cache_row_fails_the_pair():
    summary = _passing()
    del summary["full+pc"]  # skipped or failed: the pair cannot pass
    assert bench.target_checks("prefill_heavy", summary, shared_prefix_pair=True)["full_prefix_caching_ge_2x"] is False


def test_decode_heavy_targets_both_ways():
    good = {"full": _row(), "paged_eviction": _row(2.1, 3.5), "kivi2": _row(1.6, 4.0)}
    assert all(bench.target_checks("decode_heavy", good, shared_prefix_pair=False).values())
    good["paged_eviction"]["max_running_ratio_vs_full"] = math.nan
    assert not bench.target_checks("decode_heavy", good, False)["paged_eviction_max_running_ge_3x"]
