"""Paper claims judged on intervals, both ways: a relation within the noise of the items is inconclusive, a shift
on every item is reproduced (or refuted) by the paired interval though the items differ widely, the same shift on
unpaired items is inconclusive, and the streaming_llm_sinks smoke (its real per-window NLLs) gives an inconclusive
ordering and a refuted 10x collapse."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
from omegaconf import OmegaConf

from kvbench.reporting import report
from kvbench.reporting import claims, stats
from kvbench.reporting import runs as runs_module
from tests import results_fixtures as fx

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = json.loads((REPO / "tests" / "fixtures" / "streaming_llm_sinks_smoke.json").read_text())


def sinks_paper() -> dict:
    """The paper block of conf/experiment/streaming_llm_sinks.yaml, as a run's config.yaml records it."""
    cfg = OmegaConf.load(REPO / "conf" / "experiment" / "streaming_llm_sinks.yaml")
    return OmegaConf.to_container(cfg.paper, resolve=True)


def window_samples(window_nlls: list[float], size: int = 64, doc: str = "doc0") -> list[dict]:
    """One document's perplexity sample with the given per-window mean NLLs (windows of `size` tokens)."""
    tokens = size * len(window_nlls)
    nll = sum(window_nlls) / len(window_nlls)
    return [{"id": doc, "dataset": "pg_essays", "prompt": None, "prediction": None, "references": [],
             "num_tokens": tokens, "nll": nll, "ppl": math.exp(nll),
             "window_nll_sum": [v * size for v in window_nlls], "window_tokens": [size] * len(window_nlls)}]


def write_rows(path, per_sinks: dict, paper: dict, experiment: str = "claims") -> None:
    """One perplexity run per sinks value, with its samples; ppl recorded as the samples give it."""
    for sinks, samples in per_sinks.items():
        cfg = fx.config(method="streaming_llm", budget=256, method_options={"sinks": sinks}, experiment=experiment,
                        paper=paper, task_options={"corpus": "pg_essays", "max_tokens": 1024})
        sums = sum(sum(s["window_nll_sum"]) for s in samples)
        tokens = sum(sum(s["window_tokens"]) for s in samples)
        fx.write_run(str(path), cfg, {"ppl": math.exp(sums / tokens), "peak_kv_bytes": 2**20}, samples)


def judged(path, name: str = "claims"):
    names, groups = report.build(str(path), name)
    (exp, runs, history), = groups
    sec = report.experiment_section(exp, runs, history, str(path / "out"))
    return sec, {v.claim: v for v in sec.verdicts}


def test_streaming_llm_sinks_smoke_ordering_is_inconclusive_and_10x_is_refuted(tmp_path):
    """The smoke's real per-window NLLs (16 windows of 64 tokens per run): ppl 44.78 / 27.33 / 27.18 / 27.26 /
    27.29 for 0/1/2/4/8 sinks. "4 < 2 < 1 < 0" failed on 27.26 > 27.18 before, a point estimate; the paired
    interval of ppl(2) - ppl(4) reaches both sides of 0."""
    paper = sinks_paper()
    samples = {int(k): [{"id": r["id"], "dataset": "pg_essays", "prompt": None, "prediction": None,
                         "references": [], "num_tokens": r["num_tokens"], "nll": r["nll"], "ppl": r["ppl"],
                         "window_nll_sum": r["window_nll_sum"], "window_tokens": r["window_tokens"]}]
               for k, r in SMOKE["runs"].items()}
    write_rows(tmp_path, samples, paper, experiment="streaming_llm_sinks")
    sec, by = judged(tmp_path, "streaming_llm_sinks")
    order = by["more sinks, lower perplexity, up to 4: 4 < 2 < 1 < 0 sinks"]
    assert order.ours == "27.26 > 27.18 < 27.33 < 44.78" and order.verdict == "inconclusive"
    assert order.items == "paired over 16 windows"
    s2_s4 = order.settings[0][5][0]  # ppl(2 sinks) - ppl(4 sinks)
    assert s2_s4[0] < 0 < s2_s4[1]
    collapse = by["window attention alone collapses: 0 sinks > 10x the 4-sink perplexity"]
    lo, hi = collapse.settings[0][5][0]
    assert collapse.verdict == "not reproduced" and 1.2 < lo < 44.78 / 27.26 < hi < 10
    assert collapse.interval == f"x[{lo:.4g}, {hi:.4g}]"
    assert sec.verdict[0] == "not reproduced"  # a refuted claim decides
    assert "16 perplexity windows" in sec.verdict[1] and "5 runs of 1 sample" in sec.verdict[1]
    assert "not the paper's model (meta-llama/Llama-2-7b-hf)" in sec.verdict[1]


PAPER = {"source": "s", "model": "m", "dataset": "d", "metric": "ppl", "lower_is_better": True,
         "rows": [{"id": "a", "label": "a", "match": {"method.sinks": 4}, "value": None},
                  {"id": "b", "label": "b", "match": {"method.sinks": 1}, "value": None}],
         "claims": [{"claim": "a < b", "order": ["a", "b"]},
                    {"claim": "b > 1.05x a", "ratio": ["b", "a"], "min": 1.05},
                    {"claim": "b within 1% of a", "ratio": ["b", "a"], "min": 0.99, "max": 1.01}]}
RNG = np.random.default_rng(7)
BASE = list(3.3 + RNG.normal(0.0, 0.6, 16))  # windows that differ widely among themselves


@pytest.mark.parametrize("case,want", [
    # every window of b 0.1 nats worse: the paired interval finds it (ppl x1.105) though windows spread +-0.6
    ("shift", {"a < b": "reproduced", "b > 1.05x a": "reproduced", "b within 1% of a": "not reproduced"}),
    # b worse on some windows, better on others, by +-0.05 around +0.005: within the noise
    ("noise", {"a < b": "inconclusive", "b > 1.05x a": "not reproduced", "b within 1% of a": "inconclusive"}),
    # b better on every window: the ordering is refuted, not merely unproven
    ("better", {"a < b": "not reproduced", "b > 1.05x a": "not reproduced", "b within 1% of a": "not reproduced"}),
    # the shift of "shift", but the rows scored different documents: unpaired, each run's own interval is wide
    ("unpaired", {"a < b": "inconclusive", "b > 1.05x a": "inconclusive", "b within 1% of a": "inconclusive"}),
])
def test_claims_judged_on_the_interval_both_ways(tmp_path, case, want):
    wiggle = [0.05 if i % 2 else -0.04 for i in range(16)]
    b = {"shift": [v + 0.1 for v in BASE], "noise": [v + w for v, w in zip(BASE, wiggle)],
         "better": [v - 0.1 for v in BASE], "unpaired": [v + 0.1 for v in BASE]}[case]
    write_rows(tmp_path, {4: window_samples(BASE), 1: window_samples(b, doc="doc1" if case == "unpaired" else "doc0")},
               PAPER)
    sec, by = judged(tmp_path)
    assert {c: v.verdict for c, v in by.items()} == want
    items = "unpaired, 16 windows per run" if case == "unpaired" else "paired over 16 windows"
    assert all(v.items == items for v in by.values())
    overall = "not reproduced" if "not reproduced" in want.values() else "inconclusive"
    assert sec.verdict[0] == overall
    if case == "noise":
        assert "cannot tell" in by["a < b"].why


def test_a_claim_across_methods_is_judged_though_their_source_digests_differ(tmp_path):
    """Each run records the digest of its method's own source files (method_source_sha256): the rows of two
    methods always differ in it. It follows from the method, as the method's options do: not a setting that would
    leave every setting with a row missing ("not run"), nor a column of the report's tables."""
    paper = dict(PAPER, rows=[{"id": "a", "label": "a", "match": {"method.name": "full"}, "value": None},
                              {"id": "b", "label": "b", "match": {"method.name": "streaming_llm"}, "value": None}],
                 claims=[{"claim": "a < b", "order": ["a", "b"]}])
    for method, nlls in (("full", BASE), ("streaming_llm", [v + 0.1 for v in BASE])):
        cfg = fx.config(method=method, budget=None if method == "full" else 256, experiment="claims", paper=paper,
                        task_options={"corpus": "pg_essays", "max_tokens": 1024})
        cfg["method_source_sha256"] = method[0] * 64
        samples = window_samples(nlls)
        fx.write_run(str(tmp_path), cfg, {"ppl": samples[0]["ppl"], "peak_kv_bytes": 2**20}, samples)
    sec, by = judged(tmp_path)
    assert by["a < b"].verdict == "reproduced", by["a < b"].why
    names, groups = report.build(str(tmp_path), "claims")
    (exp, runs, history), = groups
    assert "method_source_sha256" not in runs_module.varying_keys(runs)


def test_row_draws_pair_only_aligned_items_and_hold_runs_without_samples_at_their_value():
    a, b = window_samples(BASE), window_samples([v + 0.1 for v in BASE])
    va, vb = (math.exp(sum(s[0]["window_nll_sum"]) / 1024) for s in (a, b))
    draws, info = stats.row_draws("ppl", [[(va, a)], [(vb, b)]], iters=200)
    assert info["paired"] and info["items"] == [[16], [16]] and not info["exact"]
    assert (draws[1] > draws[0]).all()  # paired: the shift shows in every draw
    draws, info = stats.row_draws("ppl", [[(va, a)], [(vb, None)]], iters=200)
    assert not info["paired"] and info["exact"] == [1] and (draws[1] == vb).all()
    # samples that do not give the recorded value are not this run's noise
    draws, info = stats.row_draws("ppl", [[(va * 2, a)], [(vb, b)]], iters=200)
    assert info["exact"] == [0] and (draws[0] == va * 2).all()
    assert claims.items_text(info, ["a", "b"]).endswith("no interval for a (fewer than 2 windows, or no samples.jsonl)")


def test_rounded_recorded_scores_keep_their_unit_and_never_shift_the_draws():
    """RULER and LongBench record 100 x mean rounded to 2 decimals (73.33 for 0.73333...): the draws use x100, not
    73.33 / 0.7333 (which put every draw of a tied row 0.0045 off, and a claim "wholly" on one side)."""
    tied = fx.score_samples([1.0, 1.0, 0.2], "vt")
    assert stats.unit_scale(73.33, 0.7333333) == 100.0 and stats.unit_scale(40.0, 0.4) == 100.0
    assert stats.unit_scale(3.0, 0.7) == pytest.approx(3.0 / 0.7)  # no power of ten: the ratio, as before
    draws, info = stats.row_draws("score", [[(73.33, tied)], [(73.33, [dict(s) for s in tied])]], iters=300)
    assert info["paired"] and (draws[0] == draws[1]).all()
    verdict, _, _ = claims.on_interval({"order": ["a", "b"]}, draws, ["a", "b"], False)
    assert verdict == "not reproduced"  # a strict "a > b" on rows tied in every draw: refuted, never "reproduced"


def test_a_ratio_over_a_zero_base_is_judged_and_written_as_json():
    """b = 0 in some draws: the ratio is inf there; the verdict still comes out and --json stays valid JSON."""
    draws = np.array([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0]])
    verdict, text, bounds = claims.on_interval({"ratio": ["a", "b"], "min": 10}, draws, ["a", "b"], True)
    assert verdict == "inconclusive" and math.isinf(bounds[0][1])
    v = claims.Verdict("c", "ppl", "ratio >= 10", "x inf", "", verdict, settings=[("all runs", "x", verdict, text,
                                                                                   "", bounds)])
    assert json.loads(json.dumps(v.as_dict(), allow_nan=False))["settings"][0]["bounds"][0][1] is None
