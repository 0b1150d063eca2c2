"""Issue 56, item 1: the run id covers the content of the data files a run reads (task.text_file, task.data_path,
task.data_dir), so editing a file at the same path is a new run, not "already finished; skipping" with the old
result; the digest is recorded as `data_sha256` in config.yaml and metrics.json."""
from __future__ import annotations

import json

import yaml

from kvbench.data_digest import data_sha256, path_sha256
from kvbench.spec import hashable_config
from kvbench.store.naming import run_id_for
from tests.harness_fakes import compose, run_fake_cli


def _run_id(*overrides: str) -> str:
    return run_id_for(hashable_config(compose(list(overrides))))


def test_editing_a_text_file_changes_the_run_id(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("one text " * 20)
    first = _run_id(f"task.text_file={f}", "task.corpus=text_file")
    assert first == _run_id(f"task.text_file={f}", "task.corpus=text_file")  # same bytes, same id
    f.write_text("another text " * 20)
    assert _run_id(f"task.text_file={f}", "task.corpus=text_file") != first


def test_editing_a_file_inside_a_data_dir_changes_the_digest(tmp_path):
    d = tmp_path / "lb"
    d.mkdir()
    (d / "trec.jsonl").write_text('{"a": 1}\n')
    (d / "nested").mkdir()
    (d / "nested" / "x.jsonl").write_text('{"b": 1}\n')
    before = data_sha256({"data_dir": str(d)})
    (d / ".cache").mkdir()  # hidden files (a loader's cache) are not data
    (d / ".cache" / "junk").write_text("x")
    assert data_sha256({"data_dir": str(d)}) == before
    (d / "nested" / "x.jsonl").write_text('{"b": 2}\n')
    assert data_sha256({"data_dir": str(d)}) != before
    (d / "nested" / "x.jsonl").rename(d / "nested" / "y.jsonl")  # same bytes under another name: other data
    assert path_sha256(str(d)) != before


def test_no_local_data_adds_nothing():
    assert data_sha256({"data_path": None, "text_file": None}) is None
    assert data_sha256({"data_path": "kvbench:smoke"}) is None
    assert data_sha256({"data_dir": "/no/such/folder"}) is None  # refused by the task's preflight
    assert "data_sha256" not in hashable_config(compose([]))  # packaged data: the default run ids stay


def test_an_edited_file_is_run_again_and_recorded(tmp_path):
    # the real CLI (Hydra's run folder named by the resolver) over the fakes: the second run is not skipped
    text = tmp_path / "t.txt"
    text.write_text("The first version of the text to score. " * 4)
    out = tmp_path / "r"
    args = (f"task.text_file={text}", "task.corpus=text_file", f"results_dir={out}")
    first = run_fake_cli(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = run_fake_cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and "already finished" in again.stdout, again.stdout  # same bytes: skipped
    text.write_text("A second, edited version of the text. " * 4)
    edited = run_fake_cli(*args, cwd=tmp_path)
    assert edited.returncode == 0, edited.stderr
    assert "already finished" not in edited.stdout, edited.stdout
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 2
    digests = set()
    for folder in folders:
        metrics = json.loads((folder / "metrics.json").read_text())
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert metrics["status"] == "ok" and metrics["data_sha256"] == config["data_sha256"]
        digests.add(metrics["data_sha256"])
    assert path_sha256(str(text)) in digests and len(digests) == 2


def test_text_file_alone_is_the_explicit_text_file_corpus(tmp_path):
    # issue 56, item 8: `task.text_file=x` records task_corpus text_file and gets the explicit spelling's run id
    from kvbench.config import validate

    f = tmp_path / "t.txt"
    f.write_text("some text " * 20)
    short = compose([f"task.text_file={f}"])
    assert _run_id(f"task.text_file={f}") == _run_id(f"task.text_file={f}", "task.corpus=text_file")
    assert validate(short).task_options["corpus"] == "text_file"
    assert hashable_config(short)["task"]["corpus"] == "text_file"


def test_a_methods_own_files_are_in_the_run_id(tmp_path):
    """KVzap's surrogate folder (method.path, or a wrapper's base_options.path) edited at the same path is another
    run; the same bytes are the same run; a method naming no local file keeps its id."""
    folder = tmp_path / "surrogate"
    folder.mkdir()
    (folder / "config.json").write_text('{"input_dim": 8}')
    first = _run_id("method=kvzap", f"method.path={folder}", "compression_ratio=0.5")
    assert first == _run_id("method=kvzap", f"method.path={folder}", "compression_ratio=0.5")
    via_base = _run_id("method=dms", "method.threshold=-4", f"+method.base_options.path={folder}")
    (folder / "config.json").write_text('{"input_dim": 16}')
    assert _run_id("method=kvzap", f"method.path={folder}", "compression_ratio=0.5") != first
    assert _run_id("method=dms", "method.threshold=-4", f"+method.base_options.path={folder}") != via_base
    assert "method_files_sha256" not in hashable_config(compose(["method=kvzap", "compression_ratio=0.5"]))
