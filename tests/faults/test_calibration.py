"""The KVQuant calibration cache under faults: a truncated or corrupt file is computed again (a warning names it),
and calibrators running at once never write through one temp name."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from kvbench.quant import calibration
from kvbench.quant.calibration import CalibrationSettings, calibrate
from tests.quant.test_codec_methods import ByteTokenizer
from tests.tiny_models import tiny_model

SETTINGS = CalibrationSettings(num_sequences=2, seq_len=96)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(vocab=256, max_positions=2048, tokenizer=ByteTokenizer())


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage"])
def test_damaged_cache_file_is_recomputed_with_a_warning(tiny, tmp_path, capsys, damage):
    first = calibrate(tiny, settings=SETTINGS, cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.pt")
    whole = path.read_bytes()
    path.write_bytes({"truncated": whole[: len(whole) // 2], "empty": b"", "garbage": b"not a torch file"}[damage])
    capsys.readouterr()
    again = calibrate(tiny, settings=SETTINGS, cache_dir=tmp_path)
    err = capsys.readouterr().err
    assert "kvbench: warning:" in err and str(path) in err and "computing it again" in err
    assert not again.info["cached"] and torch.equal(again.key_levels, first.key_levels)
    third = calibrate(tiny, settings=SETTINGS, cache_dir=tmp_path)  # the rewritten file is whole again
    assert third.info["cached"] and torch.equal(third.key_levels, first.key_levels)
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left


def test_concurrent_calibrators_use_their_own_temp_files(tiny, tmp_path, monkeypatch):
    cal = calibrate(tiny, settings=SETTINGS, cache_dir=tmp_path, use_cache=False)
    path = tmp_path / "cal.pt"
    targets, real_save = [], torch.save

    def slow_save(obj, f):  # both writers are inside their temp file at the same time
        targets.append(str(f))
        time.sleep(0.3)
        real_save(obj, f)

    monkeypatch.setattr(calibration.torch, "save", slow_save)
    writers = [threading.Thread(target=calibration._write_cached, args=(path, cal)) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    monkeypatch.undo()
    assert len(targets) == 2 and len(set(targets)) == 2, targets
    assert all(str(t).startswith(str(tmp_path)) and str(t) != str(path) for t in targets)
    assert calibration._read_cached(path) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.pt"]
