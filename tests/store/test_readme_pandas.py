"""The README's pandas recipe, run exactly as written (extracted from README.md) on a small results folder: the
baselines (full and a codec, whose budget is null) are in the table, and groups without the value print nothing."""
from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

from tests import results_fixtures as fx

pytest.importorskip("pandas")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "docs", "results.md")


def readme_recipe() -> str:
    """The python block that follows "In pandas:" in README.md."""
    text = open(README, encoding="utf-8").read()
    start = text.index("In pandas: `runs_frame(load_runs(")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block, "no python block after 'In pandas:' in README.md"
    return block.group(1)


def results_folder(path: str) -> None:
    for method, budget, ppl in (("full", None, 25.5), ("h2o", 128, 27.0), ("h2o", 512, 26.0),
                                ("streaming_llm", 128, 28.0), ("streaming_llm", 512, 26.5)):
        cfg = fx.config(method=method, budget=budget, experiment="sweep")
        fx.write_run(path, cfg, {"ppl": ppl}, fx.ppl_samples([1.0]))
    cfg = fx.config(method="full", quant={"name": "kivi", "bits": 2}, experiment="sweep")
    fx.write_run(path, cfg, {"ppl": 25.9}, fx.ppl_samples([1.0]))
    for budget in (128, 512):  # another task: no ppl, a group of its own that the recipe skips
        cfg = fx.config(method="h2o", budget=budget, task="needle", experiment="sweep")
        fx.write_run(path, cfg, {"accuracy": 1.0}, fx.score_samples([1]))


def test_readme_pandas_recipe_keeps_the_baselines(tmp_path, monkeypatch):
    code = readme_recipe()
    assert 'load_runs("results")' in code
    results_folder(str(tmp_path / "results"))
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (pandas recipe)", "exec"), {})
    text = out.getvalue()
    assert "Empty DataFrame" not in text
    rows, method = {}, None
    for line in text.splitlines()[2:]:  # pandas prints a repeated index value (method) once
        if not line.strip():
            continue
        parts = line.split()
        if not line[0].isspace():
            method, parts = parts[0], parts[1:]
        rows[(method, parts[0])] = parts[1:]
    assert rows[("full", "none")] == ["NaN", "NaN", "25.5"]  # the baseline row, in the <NA> budget column
    assert rows[("full", "kivi")] == ["NaN", "NaN", "25.9"]
    assert rows[("h2o", "none")] == ["27.0", "26.0", "NaN"]
    assert rows[("streaming_llm", "none")] == ["28.0", "26.5", "NaN"]
    assert text.count("budget") == 1  # one table: the needle group has no ppl and is skipped
