"""Torn lines of any encoding in runs.jsonl (a writer killed mid-line, cut inside a multi-byte UTF-8 character) are
skipped with one warning that counts them; the next append starts on a fresh line; a corrupt metrics.json is left
out of load_runs with a warning."""
from __future__ import annotations

import json

from tests.harness_fakes import run_fake_cli
from kvbench.store.files import read_jsonl
from kvbench.store.folder import RunFolder
from kvbench.store.runs import load_runs
from kvbench.store.table import runs_frame


def _torn_index(path):
    whole = json.dumps({"run_id": "a", "note": "café ☕"}, ensure_ascii=False).encode("utf-8") + b"\n"
    torn = json.dumps({"run_id": "b", "note": "naïve ☕ résumé"}, ensure_ascii=False).encode("utf-8")
    cut = torn.index("☕".encode("utf-8")) + 1  # inside the 3-byte character
    path.write_bytes(whole + torn[:cut])
    return whole


def test_torn_multibyte_line_is_skipped_with_a_count(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    _torn_index(path)
    recs = read_jsonl(str(path))
    assert [r["run_id"] for r in recs] == ["a"]
    err = capsys.readouterr().err
    assert "skipped 1 torn or corrupt line(s)" in err and str(path) in err
    with open(path, "ab") as f:
        f.write(b"\n\xff\xfe not json\n{\"run_id\": \"c\"}\n")
    df = runs_frame(load_runs(str(tmp_path), history=True))
    assert list(df["run_id"]) == ["a", "c"]
    assert "skipped 2 torn or corrupt line(s)" in capsys.readouterr().err


def test_a_run_after_a_torn_line_appends_a_whole_line(tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    _torn_index(out / "runs.jsonl")
    proc = run_fake_cli("budget=8", f"results_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = (out / "runs.jsonl").read_bytes().split(b"\n")
    assert json.loads(lines[0])["run_id"] == "a"
    assert json.loads(lines[2])["budget"] == 8  # the torn line was ended; the new record is whole
    assert [r.get("budget") for r in read_jsonl(str(out / "runs.jsonl"), quiet=True)] == [None, 8]


def test_corrupt_metrics_json_is_reported_by_load_runs(tmp_path, capsys):
    good = RunFolder(str(tmp_path), "good")
    good.start("a: 1\n")
    good.finish({"run_id": "good", "status": "ok"})
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.json").write_bytes(b'{"run_id": "bad", "status": "o\xe2\x98')  # torn inside a character
    df = runs_frame(load_runs(str(tmp_path)))
    assert list(df["run_id"]) == ["good"]
    err = capsys.readouterr().err
    assert "skipped 1 run folder(s) with a corrupt metrics.json" in err and "bad" in err
