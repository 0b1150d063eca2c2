"""Issue 56, item 1 (hub data): a hub dataset is read at the revision `task.revision` names, and the commit read is
recorded as `data_revision` in metrics.json, so report and compare tell two versions of hub data apart. The hub is
never reached: `datasets.load_dataset` and the hub client are replaced by fakes that record their arguments."""
from __future__ import annotations

import sys
import types

import pytest

from kvbench.data import hub
from kvbench.reporting.runs import pair_key

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeDatasets(types.ModuleType):
    """`datasets` with a load_dataset that returns `rows` and records its calls."""

    def __init__(self, rows):
        super().__init__("datasets")
        self.rows, self.calls = rows, []

    def load_dataset(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return list(self.rows)


@pytest.fixture
def fake_hub(monkeypatch):
    asked = []

    class FakeApi:
        def dataset_info(self, repo, revision=None):
            asked.append((repo, revision))
            return types.SimpleNamespace(sha=SHA if revision in (None, "main") else "f" * 40)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(HfApi=FakeApi))
    monkeypatch.setattr(hub, "require_hub", lambda *a, **k: None)
    monkeypatch.setattr(hub, "hub_unreachable_reason", lambda *a, **k: None)
    hub.revisions_read(clear=True)
    yield asked
    hub.revisions_read(clear=True)


def _install(monkeypatch, rows):
    fake = FakeDatasets(rows)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    return fake


def test_the_revision_reaches_load_dataset_and_the_commit_read_is_recorded(monkeypatch, fake_hub):
    from kvbench.data import text_corpora

    monkeypatch.setattr(text_corpora, "require_hub", lambda *a, **k: None)
    fake = _install(monkeypatch, [{"text": "a"}, {"text": "b"}])
    text_corpora.load_hub_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", "test", None, revision="v1.0")
    assert fake.calls[-1][1] == {"split": "test", "revision": "v1.0"}
    assert hub.revisions_read() == "Salesforce/wikitext@" + "f" * 40
    assert fake_hub == [("Salesforce/wikitext", "v1.0")]
    text_corpora.load_hub_dataset("emozilla/pg19-test", None, "test", None)  # the default branch
    assert fake.calls[-1][1] == {"split": "test", "revision": None}
    assert hub.revisions_read(clear=True) == f"Salesforce/wikitext@{'f' * 40}; emozilla/pg19-test@{SHA}"
    assert hub.revisions_read() is None


def test_a_commit_pins_itself_without_asking_the_hub(fake_hub):
    assert hub.resolved_commit("THUDM/LongBench", SHA) == SHA
    assert fake_hub == []


def test_longbench_and_ruler_pass_the_revision(monkeypatch, fake_hub):
    from kvbench.data import longbench, ruler

    row = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "trec", "language": "en",
           "all_classes": None, "_id": "x"}
    fake = _install(monkeypatch, [row])
    assert len(longbench.load_longbench("trec", revision="main")) == 1
    assert fake.calls[-1] == (("THUDM/LongBench", "trec"), {"split": "test", "revision": "main"})
    good = {"context": "c", "question": "q", "answer_prefix": "A:", "answer": ["7"], "task": "niah_single_1",
            "max_new_tokens": 8}
    fake.rows = [good]
    out = ruler.load_hub_samples(4096, ["niah_single_1"], revision=SHA)
    assert fake.calls[-1] == (("simonjegou/ruler", "4096"), {"split": "test", "revision": SHA})
    assert out["niah_single_1"][0]["answer"] == ["7"]
    assert hub.revisions_read() == f"THUDM/LongBench@{SHA}; simonjegou/ruler@{SHA}"
    fake.rows = [good, {**good, "answer": "7"}]  # hub rows are checked like local ones
    with pytest.raises(ValueError, match="simonjegou/ruler 4096 row 1: field 'answer' is a string"):
        ruler.load_hub_samples(4096, ["niah_single_1"])


def _run(revision=None, **metrics):
    m = {"status": "ok", "model": "m", "method": "full", "task": "longbench", **metrics}
    if revision is not None:
        m["data_revision"] = revision
    return {"metrics": m, "config": {}}


def test_two_hub_revisions_are_two_settings_to_compare():
    a, b = _run(f"THUDM/LongBench@{SHA}"), _run(f"THUDM/LongBench@{'f' * 40}")
    assert pair_key(a) == pair_key(_run(f"THUDM/LongBench@{SHA}"))  # the same data pairs (no false alarm)
    assert pair_key(a) != pair_key(b)  # other data never pairs as the same setting (no false pass)
    assert pair_key(_run()) == pair_key(_run())  # local or packaged data: unchanged


def test_the_run_records_the_commits_its_task_read(fake_hub, tmp_path):
    """kvbench.run.app records `data_revision` from what the task read during the run, and nothing for a task that
    read no hub data (the previous run's reads do not leak into the next record)."""
    from kvbench.run import app
    from kvbench.tasks.base import TaskResult

    class HubTask:
        def run(self, engine, tokenizer, settings, progress):
            hub.note_revision_read("THUDM/LongBench", "main")
            return TaskResult(metrics={"score": 1.0}, samples=[{"id": "0"}])

    class LocalTask:
        def run(self, engine, tokenizer, settings, progress):
            return TaskResult(metrics={"score": 1.0}, samples=[{"id": "0"}])

    engine = types.SimpleNamespace(memory_stats=lambda: {}, speculator=None)
    loaded = types.SimpleNamespace(tokenizer=None)
    settings = types.SimpleNamespace(progress=False, budget=None)
    record: dict = {}
    app._execute(types.SimpleNamespace(task=HubTask(), settings=settings), str(tmp_path), loaded, engine, record)
    assert record["data_revision"] == f"THUDM/LongBench@{SHA}"
    hub.note_revision_read("stale/repo", SHA)  # read outside a run (e.g. a failed earlier run): not recorded
    record = {}
    app._execute(types.SimpleNamespace(task=LocalTask(), settings=settings), str(tmp_path), loaded, engine, record)
    assert "data_revision" not in record
