"""Issue 56, item 6: a run folder's name is never hidden or empty: `model.path=.` names the run after the folder
itself, `model.name=..` after a safe word, so kvbench-report and kvbench-compare (which skip dot-folders) see it."""
from __future__ import annotations

import os

from kvbench.run.spec import hashable_config
from kvbench.store.naming import model_label, run_id_for, slug
from kvbench.store.runs import load_runs
from tests.harness_fakes import compose, run_fake_cli


def test_dots_never_start_a_run_id(tmp_path, monkeypatch):
    (tmp_path / "Llama-tiny").mkdir()
    monkeypatch.chdir(tmp_path / "Llama-tiny")
    assert model_label({"name": "smollm2-135m", "path": "."}) == "Llama-tiny"
    for overrides in (["model.path=."], ["model.name=.."], ["model.name=.hidden"], ["model.name=..."],
                      ["model=hf", "model.path=.."]):
        run_id = run_id_for(hashable_config(compose(overrides)))
        assert not run_id.startswith((".", "-", "_")), (overrides, run_id)
    assert [slug(v) for v in ("..", ".x", "-x", "a..b", "")] == ["x", "x", "x", "a..b", "x"]


def test_a_run_named_dot_dot_is_a_visible_folder(tmp_path):
    out = tmp_path / "r"
    proc = run_fake_cli("model.name=..", f"results_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (folder,) = [name for name in os.listdir(out) if os.path.isdir(out / name)]
    assert not folder.startswith(".") and folder.startswith("x_perplexity_h2o")
    assert [os.path.basename(r["run_dir"]) for r in load_runs(str(out))] == [folder]
