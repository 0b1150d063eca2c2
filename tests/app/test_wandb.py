"""W&B logging: offline into the run folder without a key, off when disabled, never fatal."""
from __future__ import annotations

import builtins
import glob
import json
import os
from types import SimpleNamespace

import pytest

from tests.harness_fakes import FakeEngine, compose, fake_build_method, fake_loader
from kvbench.run import app
from kvbench.reporting.wandb_logger import WandbLogger, resolve_mode


def run_fake(tmp_path, overrides=()):
    cfg = compose([f"results_dir={tmp_path}", "task.max_tokens=40", "task.chunk_size=4", *overrides])
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
    cfg = compose([f"results_dir={tmp_path}", "task.max_tokens=40", "task.chunk_size=4", "budget=8", "method=h2o"])
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


# --------------------------------------------------------------------------- offline runs, read back
def offline_records(run_folder) -> list:
    """The records of the one offline W&B run under run_folder/wandb (its .wandb file: W&B's LevelDB-log framing of
    protobuf Records: a 7-byte header, then 32 KiB blocks of chunks with a 7-byte crc/length/type header)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    [path] = glob.glob(os.path.join(str(run_folder), "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, out, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        parts = chunk if kind == 2 else parts + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def offline_run(run_folder) -> dict:
    """{"run": the run record, "config": {key: value}, "history": [{key: value}], "summary": {key: value},
    "dir": the offline run's folder} of the offline W&B run under run_folder."""
    config, history, summary, run = {}, [], {}, None
    for rec in offline_records(run_folder):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run = rec.run
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            history.append({".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({".".join(u.nested_key) or u.key: json.loads(u.value_json) for u in rec.summary.update})
    [folder] = glob.glob(os.path.join(str(run_folder), "wandb", "offline-run-*"))
    return {"run": run, "config": config, "history": history, "summary": summary, "dir": folder}


def test_constants_go_to_the_config_and_measurements_to_the_metrics(tmp_path, no_wandb_env, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    # a generous start-up bound: on a loaded machine W&B's service can take more than the default 30 s to start
    rec = run_fake(tmp_path, ["budget=16", "method=h2o", "seed=3", "logger.init_timeout_s=300"])
    assert rec["status"] == "ok"
    logged = offline_run(tmp_path / rec["run_id"])
    config, summary = logged["config"], logged["summary"]
    metrics = {k for row in logged["history"] for k in row if not k.startswith("_")}
    for constant in ("pid", "seed", "budget", "task_max_tokens", "host", "run_id", "config_hash", "started_at"):
        assert constant in config and constant not in metrics and constant not in summary, constant
    assert config["seed"] == 3 and config["budget"] == 16 and config["pid"] == os.getpid()
    assert config["task"]["max_tokens"] == 40 and config["method"]["name"] == "h2o"  # the resolved config, whole
    for measured in ("ppl", "nll", "peak_kv_bytes", "wall_s", "num_samples"):
        assert measured in metrics and measured not in config, measured
    assert summary["status"] == "ok" and summary["ppl"] == rec["ppl"]
    assert logged["run"].run_group == ""  # one run, no experiment: no group


def test_a_sweeps_runs_share_a_group_and_its_end_logs_a_table_and_plots(tmp_path):
    """`-m` runs share the sweep's group; at the end one more run (job type sweep) in that group holds the results
    table (a row per run) and the report's plots."""
    pytest.importorskip("wandb")
    import subprocess
    import sys

    from tests.harness_fakes import fake_env
    from kvbench.reporting.wandb_logger import sweep_group

    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "tests.harness_fakes", "-m", "task.max_tokens=40", "task.chunk_size=4",
                           "task.chunk_size=16", "method=h2o,streaming_llm", "budget=8,16", f"results_dir={out}",
                           "logger.wandb=true", "logger.init_timeout_s=300"], cwd=tmp_path, env=fake_env(WANDB_MODE="offline"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    folders = sorted(p for p in out.iterdir() if (p / "metrics.json").exists())
    assert len(folders) == 4
    group = sweep_group(str(out))
    runs = [offline_run(f) for f in folders]
    assert {r["run"].run_group for r in runs} == {group}
    assert all(json.loads((f / "metrics.json").read_text())["wandb_group"] == group for f in folders)

    sweep = offline_run(out)  # results_dir/wandb: the sweep's own run
    assert sweep["run"].run_group == group and sweep["run"].job_type == "sweep"
    assert sweep["summary"]["num_runs"] == 4 and sweep["summary"]["num_ok"] == 4
    [table_file] = glob.glob(os.path.join(sweep["dir"], "files", "media", "table", "sweep_results_*.table.json"))
    with open(table_file) as f:
        table = json.load(f)
    run_ids = [row[table["columns"].index("run_id")] for row in table["data"]]
    assert sorted(run_ids) == sorted(f.name for f in folders)
    assert "ppl" in table["columns"] and "budget" in table["columns"]
    images = glob.glob(os.path.join(sweep["dir"], "files", "media", "images", "plots", "*.png"))
    assert images, os.listdir(os.path.join(sweep["dir"], "files", "media"))
    assert any(k.startswith("plots/") for row in sweep["history"] for k in row)
