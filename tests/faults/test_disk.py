"""A full disk: runs.jsonl gets whole lines or none (never a short record), an I/O error inside a run is recorded
as a failed run where the disk allows, and the sweep goes on. The filesystem test mounts a small tmpfs (root only)."""
from __future__ import annotations

import errno
import json
import os
import subprocess

import pytest

from tests.harness_fakes import FakeEngine, compose, fake_build_method, fake_loader, run_fake_cli
from kvbench.run import exit_channel
from kvbench.commands import hydra_task
from kvbench.store.files import append_jsonl, read_jsonl
from kvbench.store.folder import RunFolder, finished_metrics


def test_short_write_is_taken_back_and_raised(tmp_path, monkeypatch):
    path = str(tmp_path / "runs.jsonl")
    append_jsonl(path, {"run_id": "a"})
    before = open(path, "rb").read()
    real_write = os.write
    calls = []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))  # a short write (what a nearly full disk does)...
        raise OSError(errno.ENOSPC, "No space left on device")  # ...then no space at all

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError, match="No space left"):
        append_jsonl(path, {"run_id": "b", "text": "é" * 100})
    monkeypatch.undo()
    assert open(path, "rb").read() == before  # the partial record was taken back out
    append_jsonl(path, {"run_id": "c"})
    assert [r["run_id"] for r in read_jsonl(path)] == ["a", "c"]


def test_short_writes_are_completed(tmp_path, monkeypatch):
    path = str(tmp_path / "runs.jsonl")
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    append_jsonl(path, {"run_id": "a", "x": list(range(50))})
    monkeypatch.undo()
    assert read_jsonl(path)[0]["x"] == list(range(50))


def test_io_error_in_a_run_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(exit_channel, "_exit_code", 0)

    def full_disk(self, samples):
        raise OSError(errno.ENOSPC, "No space left on device")

    fakes = dict(load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method)
    base = [f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4", "method=h2o"]
    with monkeypatch.context() as m:
        m.setattr(RunFolder, "write_samples", full_disk)
        first = hydra_task.main(compose([*base, "budget=8"]), **fakes)
    assert first["status"] == "failed" and "No space left" in first["error"]
    second = hydra_task.main(compose([*base, "budget=16"]), **fakes)  # the sweep goes on
    assert second["status"] == "ok" and exit_channel.exit_code() == 1
    statuses = sorted((r["budget"], r["status"]) for r in read_jsonl(str(tmp_path / "runs.jsonl")))
    assert statuses == [(8, "failed"), (16, "ok")]
    assert "No space left" in capsys.readouterr().err


@pytest.fixture
def tiny_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mnt)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_filesystem_never_leaves_a_short_record(tiny_tmpfs, tmp_path):
    out = tiny_tmpfs / "r"
    proc = run_fake_cli("-m", "budget=8,16,24,32,40,48,56,64", "task.max_tokens=80", f"results_dir={out}", cwd=tmp_path)
    assert proc.returncode != 0  # the disk filled up: not a success
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("kvbench run OK") >= 1
    raw = (out / "runs.jsonl").read_bytes()
    assert raw.endswith(b"\n")
    lines = raw.splitlines()
    indexed = [json.loads(line.decode("utf-8")) for line in lines]  # every line whole
    assert len(indexed) >= 1
    for rec in indexed:  # every index line is its folder's metrics.json
        metrics = json.loads((out / rec["run_id"] / "metrics.json").read_text())
        assert metrics["attempt_id"] == rec["attempt_id"]
    # every OK summary printed is a run whose folder holds status ok
    ok_folders = [p for p in out.iterdir() if p.is_dir() and finished_metrics(str(p))]
    assert len(ok_folders) >= proc.stdout.count("kvbench run OK")
    # a disk that has room again: the next run repairs whatever the index missed
    big = tmp_path / "big"
    subprocess.run(["mount", "-o", "remount,size=1m", str(tiny_tmpfs)], check=True)
    again = run_fake_cli("budget=8", "task.max_tokens=80", f"results_dir={out}", cwd=big.parent)
    assert again.returncode == 0, again.stderr
    runs = read_jsonl(str(out / "runs.jsonl"))
    assert {r["run_id"] for r in runs} >= {p.name for p in ok_folders}
    assert len({r["attempt_id"] for r in runs}) == len(runs)  # none twice


def test_a_full_disk_is_a_fault_not_bad_input(tiny_tmpfs, tmp_path):
    """Exit 1 (not the bad-input code 2), one line naming the file and the OS error, no traceback."""
    (tiny_tmpfs / "r").mkdir()
    with open(tiny_tmpfs / "fill", "wb") as f:  # fill the disk
        try:
            f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    proc = run_fake_cli("budget=8", f"results_dir={tiny_tmpfs / 'r'}", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvbench: error: could not write ") and str(tiny_tmpfs / "r") in lines[0]
    assert "No space left on device" in lines[0] and "results_dir" not in lines[0]


def test_a_full_disk_before_config_yaml_names_the_folder(tmp_path, monkeypatch, capsys):
    # the claim is the first write of a run (before config.yaml): an error without a file name still names the folder
    monkeypatch.setattr(exit_channel, "_exit_code", 0)

    def full_disk(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RunFolder, "claim", full_disk)
    fakes = dict(load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method)
    capsys.readouterr()
    assert hydra_task.main(compose([f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4"]), **fakes) is None
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device (ENOSPC)" in lines[0], lines
    assert f"could not write {tmp_path}{os.sep}" in lines[0], lines  # the run's folder under results_dir
    assert exit_channel.exit_code() == 1


def test_a_run_recorded_ok_is_not_reported_failed_when_only_its_index_line_fails(tmp_path, monkeypatch, capsys):
    # issue 56: near a full disk, metrics.json said ok while the CLI said "run failed": the folder is the truth
    import kvbench.store.folder as folder_mod

    monkeypatch.setattr(exit_channel, "_exit_code", 0)

    def no_space(fd, path, lines):
        raise OSError(errno.ENOSPC, "No space left on device")

    fakes = dict(load_model_fn=fake_loader(), engine_cls=FakeEngine, build_method_fn=fake_build_method)
    base = [f"results_dir={tmp_path}", "logger.wandb=false", "task.max_tokens=40", "task.chunk_size=4", "method=h2o"]
    with monkeypatch.context() as m:
        m.setattr(folder_mod, "append_locked", no_space)
        capsys.readouterr()
        record = hydra_task.main(compose([*base, "budget=8"]), **fakes)
    err = capsys.readouterr().err
    assert record["status"] == "ok" and exit_channel.exit_code() == 0, err
    assert json.loads(open(os.path.join(record["run_dir"], "metrics.json")).read())["status"] == "ok"
    assert "run failed" not in err and "runs.jsonl line could not be written (No space left on device)" in err
    assert not os.path.exists(tmp_path / "runs.jsonl") or read_jsonl(str(tmp_path / "runs.jsonl")) == []
    from kvbench.store.runs import load_runs

    assert [r["metrics"]["budget"] for r in load_runs(str(tmp_path))] == [8]  # load_runs repairs the index
    assert [r["budget"] for r in read_jsonl(str(tmp_path / "runs.jsonl"))] == [8]
