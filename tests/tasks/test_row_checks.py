"""Issue 56, items 4 and 5: rows are checked against the task's schema (types, not only column names) and every data
source before the model loads; a UTF-8 byte order mark is dropped, never scored. The CLI cases (one line, exit 2, no
run folder) are rows of tests/app/test_bad_input.py."""
from __future__ import annotations

import json

import pytest

from kvbench.data.longbench import check_data_rows, load_longbench
from kvbench.data.longbench_schema import check_record
from kvbench.data.local_rows import check_rows
from kvbench.data.text_corpora import load_text_file
from kvbench.errors import UserError
from tests.harness_fakes import run_fake_cli

ROW = {"input": "q", "context": "c", "answers": ["a"], "length": 1, "dataset": "trec", "language": "en",
       "all_classes": ["a", "b"], "_id": "x"}


@pytest.mark.parametrize("change,needle", [
    ({"context": None}, "field 'context' is null; expected a string"),
    ({"context": 3}, "field 'context' is a number (3); expected a string"),
    ({"answers": {"a": "0"}}, "field 'answers' is an object; expected a non-empty list of strings"),
    ({"answers": []}, "field 'answers' is a list"),
    ({"answers": ["a", 1]}, "field 'answers' is a list"),
    ({"input": None}, "field 'input' is null; expected a string"),
    ({"all_classes": "a"}, "field 'all_classes' is a string ('a'); expected null or a list of strings"),
    ({"length": "long"}, "field 'length' is a string"),
    ({"length": 1.5}, "field 'length' is a number (1.5)"),
    ({"_id": 5}, "field '_id' is a number (5)"),
])
def test_a_row_of_other_types_is_refused_naming_the_field(change, needle):
    with pytest.raises(ValueError) as info:
        check_record({**ROW, **change}, "/d/trec.jsonl:7")
    assert str(info.value) == f"/d/trec.jsonl:7: {needle}" or str(info.value).startswith(f"/d/trec.jsonl:7: {needle}")


def test_rows_of_longbench_types_pass():
    check_record(ROW, "w")
    check_record({**ROW, "answers": "one", "all_classes": None, "_id": None, "length": 12.0}, "w")
    check_record({"context": "c", "answers": ["a"]}, "w")  # the optional fields absent: filled with defaults


def test_a_bad_row_past_the_limit_is_not_read(tmp_path):
    (tmp_path / "trec.jsonl").write_text(json.dumps(ROW) + "\n" + json.dumps({**ROW, "context": None}) + "\n")
    check_data_rows(str(tmp_path), ["trec"], limit=1)
    with pytest.raises(UserError, match=r"trec.jsonl:2: field 'context' is null"):
        check_data_rows(str(tmp_path), ["trec"], limit=None)
    with pytest.raises(ValueError, match=r"trec.jsonl:2: field 'context' is null"):  # the loader checks them too
        load_longbench("trec", data_dir=str(tmp_path))


def test_a_utf8_bom_is_dropped_from_longbench_rows_and_text_files(tmp_path):
    (tmp_path / "trec.jsonl").write_bytes(b"\xef\xbb\xbf" + (json.dumps(ROW) + "\n").encode())
    check_data_rows(str(tmp_path), ["trec"])
    (rec,) = load_longbench("trec", data_dir=str(tmp_path))
    assert rec["context"] == "c"
    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbfHello there.")
    assert load_text_file(str(tmp_path / "t.txt")) == "Hello there."
    (tmp_path / "w.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n')  # `datasets` reads it: so do the checks
    check_rows(str(tmp_path / "w.jsonl"), ("text",), ("text",))


def test_a_bom_does_not_change_a_perplexity(tmp_path):
    # the case: a BOM changed a perplexity (118.79 -> 115.28); the same text with and without one scores alike
    text = "A text to score, the same with a byte order mark or without one. " * 3
    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text(text)
    bom.write_bytes(b"\xef\xbb\xbf" + text.encode())
    ppl = []
    for f in (plain, bom):
        out = tmp_path / f.stem
        proc = run_fake_cli(f"task.text_file={f}", f"results_dir={out}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        (run,) = [p for p in out.iterdir() if p.is_dir()]
        ppl.append(json.loads((run / "metrics.json").read_text())["ppl"])
    assert ppl[0] == ppl[1]


def test_wikitext_rows_need_text_in_the_text_column(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(UserError, match="column 'text' holds int64, not text"):
        check_rows(str(tmp_path / "n.parquet"), ("text",), ("text",))
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "s.parquet")
    check_rows(str(tmp_path / "s.parquet"), ("text",), ("text",))
    (tmp_path / "n.json").write_text(json.dumps([{"text": "a"}, {"text": None}]))
    with pytest.raises(UserError, match="column 'text' is null; expected text"):
        check_rows(str(tmp_path / "n.json"), ("text",), ("text",))
