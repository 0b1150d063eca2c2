"""Issue 56, item 1: the run id covers the content of the data files a run reads (task.text_file, task.data_path,
task.data_dir), so editing a file at the same path is a new run, not "already finished; skipping" with the old
result; the digest is recorded as `data_sha256` in config.yaml and metrics.json."""
from __future__ import annotations

import json
import os

import yaml

from kvbench.run.data_digest import data_sha256, path_sha256
from kvbench.run.spec import hashable_config
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
    from kvbench.run.config import validate

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


# --------------------------------------------------------------------------- issue 68, item 1
def test_a_hidden_data_file_is_neither_read_nor_hashed(tmp_path):
    """scbench_kv/.data.jsonl was read (the loaders globbed every name) but not hashed: an edit reran nothing. The
    loaders now list folders as the digest does (kvbench.run.data_digest.visible_files), hidden names skipped."""
    from kvbench.data.ruler import local_files
    from kvbench.data.scbench import task_files

    scb = tmp_path / "scb" / "scbench_kv"
    scb.mkdir(parents=True)
    (scb / ".data.jsonl").write_text('{"hidden": 1}\n')
    (scb / "part-0.jsonl").write_text('{"seen": 1}\n')
    (scb / ".cache").mkdir()
    (scb / ".cache" / "x.jsonl").write_text('{"cache": 1}\n')
    assert task_files(tmp_path / "scb", "scbench_kv") == [scb / "part-0.jsonl"]
    ruler = tmp_path / "ruler" / "1024"
    ruler.mkdir(parents=True)
    (ruler / ".old.jsonl").write_text('{"hidden": 1}\n')
    (ruler / "a.parquet").write_bytes(b"x")
    assert local_files(tmp_path / "ruler", 1024) == [ruler / "a.parquet"]
    before = data_sha256({"data_dir": str(tmp_path / "scb")})
    (scb / ".data.jsonl").write_text('{"hidden": 2}\n')  # not read, so not the run's identity
    assert data_sha256({"data_dir": str(tmp_path / "scb")}) == before
    (scb / "part-0.jsonl").write_text('{"seen": 2}\n')  # read, so another run
    assert data_sha256({"data_dir": str(tmp_path / "scb")}) != before


def test_a_data_path_folder_skips_hidden_files(tmp_path):
    from kvbench.data.text_corpora import _local_files

    folder = tmp_path / "wt"
    (folder / ".old").mkdir(parents=True)
    (folder / "test.jsonl").write_text('{"text": "a"}\n')
    (folder / ".old" / "test.jsonl").write_text('{"text": "hidden"}\n')
    _, files = _local_files(str(folder), "test", None)
    assert files == [str(folder / "test.jsonl")]


def _tiny_model_folder(folder):
    from tests.tiny_models import tiny_hf_model

    tiny_hf_model("llama", layers=2).save_pretrained(folder)
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": []}')
    return folder


def test_the_models_files_are_in_the_run_id(tmp_path):
    """rms_norm_eps edited in config.json reused the old ppl: the model's config, tokenizer and weights are in the
    identity (model_sha256); its documentation is not."""
    folder = _tiny_model_folder(tmp_path / "m")
    first = _run_id("model=hf", f"model.path={folder}")
    assert first == _run_id("model=hf", f"model.path={folder}")
    assert hashable_config(compose(["model=hf", f"model.path={folder}"]))["model_sha256"]
    (folder / "README.md").write_text("# notes\n")  # not read by the loader: the same model
    assert _run_id("model=hf", f"model.path={folder}") == first
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 0.1}))
    edited = _run_id("model=hf", f"model.path={folder}")
    assert edited != first
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "c": 1}}, "added_tokens": []}')
    assert _run_id("model=hf", f"model.path={folder}") != edited
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    before = _run_id("model=hf", f"model.path={folder}")
    weights.write_bytes(bytes(data))
    assert _run_id("model=hf", f"model.path={folder}") != before
    assert "model_sha256" not in hashable_config(compose([]))  # the packaged model: its package's version


def test_model_digests_are_stored_by_path_size_and_mtime(tmp_path, monkeypatch):
    """A 7B is hashed once: a later process reads the digest from $KVBENCH_CACHE_DIR/digests.json."""
    import kvbench.run.data_digest as dd

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(dd, "_index", None)
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\x01" * 4096)
    digest = dd.stored_file_sha256(str(weights))
    assert digest == dd.file_sha256(str(weights))
    assert digest in json.loads((tmp_path / "cache" / "digests.json").read_text()).values()
    monkeypatch.setattr(dd, "_index", None)  # a new process
    monkeypatch.setattr(dd, "file_sha256", lambda path: (_ for _ in ()).throw(AssertionError("hashed again")))
    assert dd.stored_file_sha256(str(weights)) == digest
    weights.write_bytes(b"\x02" * 4097)  # another size and mtime: hashed again
    try:
        dd.stored_file_sha256(str(weights))
        raise RuntimeError("not hashed again")
    except AssertionError:
        pass


def test_a_user_methods_source_is_in_the_run_id(tmp_path, monkeypatch):
    """A user's method file edited at the same path was reused; its source (and its base classes') is now hashed."""
    import importlib
    import sys

    from kvbench.methods import METHODS

    (tmp_path / "user_pkg").mkdir()
    (tmp_path / "user_pkg" / "__init__.py").write_text("")
    source = tmp_path / "user_pkg" / "my_edit.py"
    source.write_text("from dataclasses import dataclass\nfrom kvbench.methods import ScorerMethod, register_method\n"
                      "@register_method('my_edit')\n@dataclass\nclass MyEdit(ScorerMethod):\n"
                      "    def score(self, obs):\n        return -obs.keys.norm(dim=-1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"model": {"path": None}, "method": {"name": "my_edit"}, "task": {"name": "perplexity"}, "budget": 64,
              "seed": 0}
    try:
        importlib.import_module("user_pkg.my_edit")
        first = run_id_for(hashable_config(config))
        assert run_id_for(hashable_config(config)) == first
        source.write_text(source.read_text().replace("-obs.keys", "obs.keys"))  # the opposite ranking
        assert run_id_for(hashable_config(config)) != first
        assert hashable_config({**config, "method": {"name": "knorm"}})["method_source_sha256"]
    finally:
        METHODS._items.pop("my_edit", None)
        METHODS._files.pop("my_edit", None)
        sys.modules.pop("user_pkg.my_edit", None)
