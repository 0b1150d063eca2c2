"""Issue 56, item 3: kvbench-compare's verdicts pass / regression / inconclusive (exit 0 / 1 / 3) against a
--min-effect; a short run that cannot resolve a change is inconclusive, never PASS; ppl and nll of one run get one
verdict; a BASE run folder that cannot be read fails the gate. Item 7: NEW's error text is escaped in the Markdown.
Both ways: the same results twice pass; worse, missing and NaN scores fail."""
from __future__ import annotations

import math
import pathlib
import re

import pytest

from kvbench.console import visible
from kvbench.reporting.escape import markdown_text
from kvbench.reporting.judge import one_verdict
from tests import results_fixtures as fx
from tests.reporting.test_compare import regression_lines, run_cli, verdict_of

CFG = fx.config(task_options={"max_tokens": 1025})


def ppl_run(folder, windows: int, shifts=None, *, spread: float = 1.0, mean_nll: float = 3.0, cfg=CFG, **metric_override):
    """One perplexity document of `windows` windows whose NLLs alternate +-spread; `shifts` adds to each window's
    mean NLL (NEW worse on some windows only). Records ppl and nll as the task does."""
    s = fx.ppl_samples([mean_nll], tokens=64 * windows, windows=windows, spread=spread)
    if shifts:
        s[0]["window_nll_sum"] = [v + 64 * d for v, d in zip(s[0]["window_nll_sum"], shifts)]
    mean = sum(s[0]["window_nll_sum"]) / (64 * windows)
    s[0]["nll"], s[0]["ppl"] = mean, math.exp(mean)
    metrics = {"ppl": math.exp(mean), "nll": mean, **metric_override}
    return fx.write_run(str(folder), cfg, metrics, s)


def _rows(v, metric):
    return [r for r in v["rows"] if r["metric"] == metric]


@pytest.mark.parametrize("rise", [0.166, 0.64])
def test_four_windows_cannot_pass_a_big_rise_confined_to_one_window(tmp_path, rise):
    # the short run: 4 windows, ppl +16.6% / +64% (all of it in one window) passed; the paired interval of
    # 4 windows holds both no change and a 1% rise, so the verdict is inconclusive: exit 3, no PASS
    ppl_run(tmp_path / "a", 4)
    ppl_run(tmp_path / "b", 4, [4 * math.log1p(rise), 0, 0, 0])
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    (ppl,), (nll,) = _rows(v, "ppl"), _rows(v, "nll")
    assert ppl["change_pct"] == pytest.approx(100 * rise, rel=1e-6)
    assert ppl["verdict"] == nll["verdict"] == "inconclusive" and v["gate"] == "inconclusive" and not v["ok"]
    assert ppl["interval"][0] <= 0 < ppl["min_effect"] <= ppl["interval"][1]
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 3, proc.stdout
    assert "**INCONCLUSIVE**" in proc.stdout and "PASS" not in proc.stdout
    # told that only a sixfold rise matters, the same data rule it out: pass
    assert run_cli(tmp_path / "a", tmp_path / "b", "--min-effect", "5").returncode == 0
    # the same rise on every window is resolved: a regression
    ppl_run(tmp_path / "c", 4, [math.log1p(rise)] * 4)
    proc = run_cli(tmp_path / "a", tmp_path / "c")
    assert proc.returncode == 1 and "**FAIL**" in proc.stdout
    assert {line.split(": ")[2].split(" ")[0] for line in regression_lines(proc.stdout)} == {"ppl", "nll"}


def test_sixteen_windows_with_a_regression_in_the_last_window_only(tmp_path):
    # +20% perplexity on the last of 16 windows (ppl +1.1% overall) passed; it is inconclusive now
    ppl_run(tmp_path / "a", 16)
    ppl_run(tmp_path / "b", 16, [0.0] * 15 + [math.log(1.2)])
    v = verdict_of(tmp_path / "a", tmp_path / "b")
    verdicts = {r["metric"]: r["verdict"] for r in v["rows"] if r["kind"] == "score"}
    assert verdicts == {"ppl": "inconclusive", "nll": "inconclusive"}, v["rows"]
    assert run_cli(tmp_path / "a", tmp_path / "b").returncode == 3


def test_the_same_results_twice_pass_and_worse_missing_or_nan_fail(tmp_path):
    ppl_run(tmp_path / "a", 4)
    ppl_run(tmp_path / "same", 4)
    proc = run_cli(tmp_path / "a", tmp_path / "same")
    assert proc.returncode == 0 and "**PASS**" in proc.stdout, proc.stdout
    ppl_run(tmp_path / "worse", 4, [0.2] * 4)
    assert run_cli(tmp_path / "a", tmp_path / "worse").returncode == 1
    ppl_run(tmp_path / "better", 4, [-0.2] * 4)
    v = verdict_of(tmp_path / "a", tmp_path / "better")
    assert v["gate"] == "pass" and {r["verdict"] for r in v["rows"] if r["kind"] == "score"} == {"better"}
    for how, value in (("nan", float("nan")), ("null", None)):
        ppl_run(tmp_path / how, 4, **{"ppl": value, "nll": value})
        proc = run_cli(tmp_path / "a", tmp_path / how)
        assert proc.returncode == 1 and len(regression_lines(proc.stdout)) == 2, proc.stdout


def test_ppl_and_nll_of_one_run_get_one_verdict(tmp_path):
    # every shift of one window, from nothing to a doubling: both metrics are judged on the NLL scale
    ppl_run(tmp_path / "a", 8)
    for i, d in enumerate([0.0, 0.005, 0.02, 0.08, 0.3, 0.7]):
        for shifts in ([d] * 8, [8 * d] + [0.0] * 7):
            new = tmp_path / f"n{i}-{len(set(shifts))}"
            ppl_run(new, 8, shifts)
            v = verdict_of(tmp_path / "a", new)
            (ppl,), (nll,) = _rows(v, "ppl"), _rows(v, "nll")
            assert ppl["verdict"] == nll["verdict"], (shifts, ppl, nll)
    # a recorded ppl rounded away from exp(nll) cannot split them: the more severe verdict holds for both
    rows = [{"metric": "ppl", "kind": "score", "verdict": "ok", "note": ""},
            {"metric": "nll", "kind": "score", "verdict": "inconclusive", "note": ""}]
    one_verdict(rows)
    assert [r["verdict"] for r in rows] == ["inconclusive", "inconclusive"] and "verdict of nll" in rows[0]["note"]


def test_a_base_run_that_cannot_be_read_fails_the_gate(tmp_path):
    ppl_run(tmp_path / "a", 4)
    rec = ppl_run(tmp_path / "a", 4, cfg=fx.config(task_options={"max_tokens": 2049}))  # a second setting
    pathlib.Path(rec["run_dir"], "metrics.json").write_text('{"run_id": "x", "status": "ok", "ppl": 2')
    ppl_run(tmp_path / "b", 4)
    proc = run_cli(tmp_path / "a", tmp_path / "b")
    assert proc.returncode == 1, proc.stdout
    assert any(line.startswith(f"- REGRESSION: BASE run folder {rec['run_id']}") for line in
               regression_lines(proc.stdout)), proc.stdout
    assert "0 warnings: **FAIL**" in proc.stdout


def test_min_effect_must_be_above_float_noise(tmp_path):
    ppl_run(tmp_path / "a", 4)
    for value in ("0", "-0.1", "nan", "0.00005"):
        proc = run_cli(tmp_path / "a", tmp_path / "a", "--min-effect", value)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--min-effect" in proc.stderr, proc


def test_new_error_text_is_escaped_in_the_markdown(tmp_path):
    # item 7: a failed NEW run's error is shown as text: no image, link, HTML, table break or new line
    ppl_run(tmp_path / "a", 4)
    evil = "boom ![x](http://e.x/p.png) [click](https://e.x) <img src=x> | cell\n# heading\r\n`code` www.e.x"
    fx.write_run(str(tmp_path / "b"), CFG, {"error": evil}, [], status="failed")
    proc = run_cli(tmp_path / "a", tmp_path / "b", "--json", tmp_path / "v.json")
    assert proc.returncode == 1
    (line,) = regression_lines(proc.stdout)
    assert not re.search(r"(?<!\\)[\[\]<>|`!#]", line.split(": ", 2)[2]), line  # every one escaped
    assert "\n# heading" not in proc.stdout
    assert "\\!\\[x\\]" in line and "\\| cell" in line and "\\# heading" in line and "\\`code\\`" in line
    assert "https://" not in line and "www.e" not in line  # bare URLs are not autolinked
    assert evil in (tmp_path / "v.json").read_text().encode().decode("unicode_escape") or \
        "\\n# heading" in (tmp_path / "v.json").read_text()  # the JSON keeps the raw text


def test_escapes():
    assert markdown_text("a\nb\r\nc") == "a b  c"
    assert markdown_text("[a](b)") == "\\[a\\](b)"
    assert visible("x\x1b[31mred\x07") == "x\\x1b[31mred\\x07"


def test_report_prints_names_without_terminal_escapes(tmp_path, capsys):
    # item 7: a run folder or name holding an ESC sequence is printed as \x1b..., never sent to the terminal
    pytest.importorskip("matplotlib")
    from kvbench.reporting import report

    ppl_run(tmp_path / "r", 4)
    bad = tmp_path / "r" / "evil\x1b[2J\x1b[31mrun"
    bad.mkdir()
    (bad / "metrics.json").write_text('{"run_id": "x", "status": "ok"')  # corrupt: named on the terminal
    assert report.main([str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "evil\\x1b[2J\\x1b[31mrun" in out, out
