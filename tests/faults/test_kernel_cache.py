"""The compiled CPU kernels in $KVBENCH_CACHE_DIR/ext are code kvbench runs: a library there is loaded only if it
and its folder belong to the user and no one else can write them; otherwise the kernels are built in a private
folder (removed once loaded), with a warning. The compiler is faked: it writes a marker, not a library."""
from __future__ import annotations

import os
import subprocess

import pytest

from kvbench.runtime.backends.cpu import kernels as cpu_kernels
from kvbench.runtime.measured_times import quoted

OTHER_UID = 4242


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    builds = []

    def fake_cc(cmd, **kwargs):
        out = cmd[cmd.index("-o") + 1]
        builds.append(out)
        with open(out, "w") as f:
            f.write("built by kvbench")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(cpu_kernels.subprocess, "run", fake_cc)
    return tmp_path, builds


def _plant(folder_mode=0o755, file_mode=0o755, owner=None, symlink=False):
    path = cpu_kernels._library_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, folder_mode)
    if symlink:
        target = path.parent.parent / "elsewhere.so"
        target.write_text("planted")
        os.symlink(target, path)
    else:
        path.write_text("planted")
        os.chmod(path, file_mode)
        if owner is not None:
            os.chown(path, owner, -1)
    return path


def _needs_root():
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")


def test_a_library_of_ours_that_no_one_else_can_write_is_reused(cache, capsys):
    _, builds = cache
    path = _plant()
    assert cpu_kernels._compile() == (path, None) and builds == []
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("case", ["group-writable folder", "world-writable file", "another user's file",
                                  "symbolic link"])
def test_an_untrusted_library_is_not_loaded(cache, capsys, case):
    if case == "another user's file":
        _needs_root()
    _, builds = cache
    planted = _plant(folder_mode=0o775 if case == "group-writable folder" else 0o755,
                     file_mode=0o757 if case == "world-writable file" else 0o755,
                     owner=OTHER_UID if case == "another user's file" else None, symlink=case == "symbolic link")
    path, private = cpu_kernels._compile()
    err = capsys.readouterr().err
    assert private is not None and path.parent == private and path != planted
    assert [os.path.dirname(b) for b in builds] == [str(private)]  # built there, through its temp file
    assert path.read_text() == "built by kvbench" and planted.read_text() == "planted"
    assert (os.stat(private).st_mode & 0o077) == 0 and os.stat(private).st_uid == os.getuid()
    assert "kvbench: warning: not loading the cached CPU kernels" in err and "private folder" in err
    assert {"group-writable folder": "writable by group or others", "world-writable file": "writable by group",
            "another user's file": f"owned by uid {OTHER_UID}", "symbolic link": "symbolic link"}[case] in err


def test_the_private_build_is_removed_after_loading(cache, monkeypatch):
    _plant(folder_mode=0o777)
    loaded = []
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_kernel_error", None)
    monkeypatch.setattr(cpu_kernels.ctypes, "CDLL", lambda p: loaded.append(p) or (_ for _ in ()).throw(OSError("x")))
    assert cpu_kernels.load_kernel() is None  # the fake library cannot be set up; what matters is what was loaded
    (path,) = loaded
    assert "kvbench-ext-" in path and not os.path.exists(os.path.dirname(path))


def test_a_fresh_build_says_so_first_and_is_private(cache, capsys, monkeypatch):
    root, builds = cache
    fake_cc, said = cpu_kernels.subprocess.run, []

    def cc_after_the_message(cmd, **kwargs):
        said.append(capsys.readouterr().err)  # what was printed before the compiler started
        return fake_cc(cmd, **kwargs)

    monkeypatch.setattr(cpu_kernels.subprocess, "run", cc_after_the_message)
    old = os.umask(0o002)  # a user-private-group umask: files come out group-writable unless fixed
    try:
        path, private = cpu_kernels._compile()
    finally:
        os.umask(old)
    assert private is None and path.parent == root / "ext"
    # the time it quotes is the one bench/first_hour.py measured (kvbench/runtime/measured_times.json), dated
    assert len(said) == 1 and "kvbench: compiling the CPU kernels into" in said[0]
    assert quoted("compile") and quoted("compile") in said[0]
    assert cpu_kernels.untrusted(path) is None and cpu_kernels.untrusted(path.parent) is None
    assert cpu_kernels._compile() == (path, None) and len(builds) == 1  # trusted next time: built once


@pytest.mark.parametrize("mode,trusted", [(0o777, False), (0o775, False), (0o1777, True), (0o700, True)])
def test_a_cache_root_others_can_write_is_not_trusted(cache, capsys, mode, trusted):
    # issue 56: whoever can write a folder above ext/ can rename ext/ and plant another library in its place
    root, builds = cache
    planted = _plant()
    os.chmod(root, mode)
    try:
        path, private = cpu_kernels._compile()
    finally:
        os.chmod(root, 0o700)
    err = capsys.readouterr().err
    if trusted:  # this user's, or sticky (as /tmp): no one else can rename ext/
        assert (path, private) == (planted, None) and builds == [] and "warning" not in err
    else:
        assert private is not None and path != planted and len(builds) == 1
        assert f"{root} is writable by group or others" in err and "not loading the cached CPU kernels" in err
