"""W&B logging: offline into the run folder without a key, off when disabled, never fatal."""
from __future__ import annotations

import builtins
import glob
import json
import os
from types import SimpleNamespace

import pytest

from tests.harness_fakes import FakeEngine, compose, fake_build_method, fake_loader
from kvbench import app
from kvbench.wandb_logger import WandbLogger, resolve_mode


def run_fake(tmp_path, overrides=()):
    cfg = compose([f"results_dir={tmp_path}", "task.max_tokens=40", *overrides])
    return app.run(cfg, load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method,
                   print_summary=False)


@pytest.fixture
def no_wandb_env(monkeypatch):
    for key in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
        monkeypatch.delenv(key, raising=False)


def test_mode_resolution(no_wandb_env, monkeypatch):
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled"
    assert resolve_mode("offline") == "offline"


def test_offline_run_lands_in_the_run_folder(tmp_path, no_wandb_env, capsys):
    pytest.importorskip("wandb")
    rec = run_fake(tmp_path, ["budget=16"])
    assert rec["status"] == "ok"
    run_dir = tmp_path / rec["run_id"]
    offline = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(offline) == 1
    # it says where it logged and how to upload it
    assert f"W&B logged offline into {offline[0]}; upload it with: wandb sync {offline[0]}" in capsys.readouterr().err
    assert glob.glob(os.path.join(offline[0], "*.wandb"))  # the data file `wandb sync` uploads
    assert not os.path.exists("wandb") or os.path.abspath("wandb") == str(run_dir / "wandb")


def test_disabled_writes_nothing_and_imports_nothing(tmp_path, no_wandb_env, monkeypatch):
    real_import = builtins.__import__

    def guard(name, *a, **k):
        if name == "wandb" or name.startswith("wandb."):
            raise AssertionError("wandb imported while disabled")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", guard)
    for overrides in (["logger.wandb=false"], ["logger=none"], ["logger.mode=disabled"]):
        rec = run_fake(tmp_path, ["budget=8", "rerun=true", *overrides])
        assert rec["status"] == "ok"
        assert not (tmp_path / rec["run_id"] / "wandb").exists()


def test_missing_wandb_is_a_warning(tmp_path, no_wandb_env, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    rec = run_fake(tmp_path, ["budget=8"])
    assert rec["status"] == "ok"
    assert "warning: wandb is not installed" in capsys.readouterr().err


def test_wandb_failures_never_fail_a_run(tmp_path, no_wandb_env, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")

    def broken_init(*a, **k):
        raise RuntimeError("service unreachable")

    monkeypatch.setattr(wandb, "init", broken_init)
    rec = run_fake(tmp_path, ["budget=8"])
    assert rec["status"] == "ok"
    err = capsys.readouterr().err
    assert "warning: W&B init failed" in err and "service unreachable" in err
    metrics = json.loads((tmp_path / rec["run_id"] / "metrics.json").read_text())
    assert metrics["status"] == "ok"


def test_logging_errors_after_init_are_warnings(tmp_path, capsys):
    class Run:
        summary = SimpleNamespace(update=lambda d: None)

        def log(self, d):
            raise ValueError("bad payload")

        def finish(self, exit_code=0):
            raise RuntimeError("finish failed")

    logger = WandbLogger(SimpleNamespace(wandb=True, mode="offline", project="p", entity=None, log_samples=True),
                         run_dir=str(tmp_path), run_id="r")
    logger.run = Run()
    logger.log_result({"ppl": 1.0}, [{"id": 1}])
    logger.finish()
    err = capsys.readouterr().err
    assert "W&B logging failed" in err and "W&B finish failed" in err


def test_samples_table_and_metrics_are_logged(tmp_path, monkeypatch):
    logged, summary = [], {}

    class Run:
        def __init__(self):
            self.summary = SimpleNamespace(update=summary.update)

        def log(self, d):
            logged.append(d)

        def finish(self, exit_code=0):
            logged.append({"finished": exit_code})

    wandb = pytest.importorskip("wandb")
    logger = WandbLogger(SimpleNamespace(wandb=True, mode="offline", project="p", entity=None, log_samples=True),
                         run_dir=str(tmp_path), run_id="r")
    logger.run = Run()
    logger.log_result({"ppl": 2.5, "method": "full", "nan": float("nan")},
                      [{"id": "a", "references": ["x"], "ppl": 2.0}])
    logger.finish()
    assert logged[0] == {"ppl": 2.5}
    assert isinstance(logged[1]["samples"], wandb.Table) and logged[1]["samples"].columns == ["id", "references", "ppl"]
    assert summary["method"] == "full" and logged[-1] == {"finished": 0}


class _FakeRun:
    def __init__(self, **kw):
        self.kw = kw
        self.summary = SimpleNamespace(update=lambda d: None)

    def log(self, d):
        pass

    def finish(self, exit_code=0):
        pass


def test_online_init_is_bounded_and_falls_back_offline(tmp_path, no_wandb_env, monkeypatch, capsys):
    wandb = pytest.importorskip("wandb")
    calls = []

    def init(**kw):
        calls.append(kw)
        if kw["mode"] == "online":
            os.makedirs(os.path.join(kw["dir"], "wandb", "run-failed-online"))
            raise TimeoutError("no network")
        return _FakeRun(**kw)

    monkeypatch.setattr(wandb, "init", init)
    rec = run_fake(tmp_path, ["budget=8", "method=h2o", "logger.mode=online", "logger.init_timeout_s=7"])
    assert rec["status"] == "ok" and rec["wandb_mode"] == "offline"
    assert [c["mode"] for c in calls] == ["online", "offline"]
    assert calls[0]["settings"].init_timeout == 7 and calls[0]["settings"].login_timeout == 7
    err = capsys.readouterr().err
    assert "W&B online init failed or timed out after at most 7 s" in err and "offline" in err
    assert not (tmp_path / rec["run_id"] / "wandb" / "run-failed-online").exists()


def test_retry_removes_the_stale_offline_folder_and_groups_by_experiment(tmp_path, no_wandb_env, monkeypatch):
    wandb = pytest.importorskip("wandb")
    calls = []
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.append(kw) or _FakeRun(**kw))
    cfg = compose([f"results_dir={tmp_path}", "task.max_tokens=40", "budget=8", "method=h2o"])
    cfg.experiment = "h2o_table"  # what conf/experiment/<name>.yaml sets
    run_id = app.plan_run(cfg, build_method_fn=fake_build_method).run_id
    stale = tmp_path / run_id / "wandb" / "offline-run-20250101_000000-killed"
    stale.mkdir(parents=True)  # the offline folder of a killed attempt
    rec = app.run(cfg, load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method,
                  print_summary=False)
    assert not stale.exists()
    assert calls[0]["group"] == "h2o_table" and rec["experiment"] == "h2o_table"
    metrics = json.loads((tmp_path / run_id / "metrics.json").read_text())
    assert metrics["experiment"] == "h2o_table"
