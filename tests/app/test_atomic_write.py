"""kvbench.atomic_write: the one temp-file-then-os.replace helper (store, caches, kernels' build, GGUF conversion)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvbench import atomic_write

ROOT = Path(__file__).resolve().parents[2]


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_write_text_writes_with_the_umask_mode_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "a.json"
    atomic_write.write_text(target, "one")
    atomic_write.write_text(target, "two")
    assert target.read_text() == "two"
    assert _listing(target.parent) == ["a.json"]
    assert target.stat().st_mode & 0o777 == atomic_write.FILE_MODE  # not mkstemp's 0600


def test_explicit_mode_is_applied_after_the_writer_ran(tmp_path):
    target = tmp_path / "lib.so"
    with atomic_write.replaced(target, mode=0o755) as tmp:
        os.unlink(tmp)  # a linker removes and recreates its -o file: the mode must still be set
        Path(tmp).write_bytes(b"\x7fELF")
    assert target.stat().st_mode & 0o777 == 0o755
    atomic_write.write_text(tmp_path / "private", "x", mode=0o600)
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("fail_in", ["writer", "os.replace"])
def test_a_failure_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch, fail_in):
    target = tmp_path / "metrics.json"
    target.write_text("old")
    if fail_in == "os.replace":
        def boom(src, dst):
            raise OSError("disk full")
        monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        with atomic_write.replaced(target) as tmp:
            Path(tmp).write_text("half")
            if fail_in == "writer":
                raise OSError("disk full")
    assert target.read_text() == "old"
    assert _listing(tmp_path) == ["metrics.json"]


def test_fsync_only_when_asked(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    atomic_write.write_text(tmp_path / "a", "x")
    assert synced == []
    atomic_write.write_text(tmp_path / "b", "x", fsync=True)
    assert len(synced) == 1


def test_a_folder_replaces_the_old_folder_whole_or_not_at_all(tmp_path):
    out = tmp_path / "converted"
    out.mkdir()
    (out / "stale.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write.replaced(out, folder=True) as tmp:
            Path(tmp).mkdir()  # the caller makes the folder: the path does not exist yet
            (Path(tmp) / "model.safetensors").write_text("half")
            raise RuntimeError("conversion failed")
    assert _listing(out) == ["stale.bin"] and _listing(tmp_path) == ["converted"]
    with atomic_write.replaced(out, folder=True) as tmp:
        assert not os.path.exists(tmp)
        Path(tmp).mkdir()
        (Path(tmp) / "model.safetensors").write_text("new")
    assert _listing(out) == ["model.safetensors"] and _listing(tmp_path) == ["converted"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~atomic_write._UMASK  # as mkdir made it, not mkdtemp's 0700


def test_no_other_module_renames_files_into_place():
    """The pattern lives once: any other os.replace / os.rename / Path.rename in kvbench/ or methods/ is a copy of
    it."""
    pattern = re.compile(r"\bos\.(replace|rename)\(|\.rename\(")
    files = [*(ROOT / "kvbench").rglob("*.py"), *(ROOT / "methods").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in files if p.name != "atomic_write.py"
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if pattern.search(line.split("#")[0])]
    assert found == []
