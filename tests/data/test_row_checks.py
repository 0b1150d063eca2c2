"""data/row_checks.py: the row reading and refusals data/ruler.py, data/scbench.py and data/longbench_schema.py share."""
from __future__ import annotations

import json

import pytest

from kvbench.data import ruler as rd
from kvbench.data import scbench as sd
from kvbench.data.row_checks import check_fields, check_object, kind, refuse_field, rows_with_place

RULER_ROW = {"context": "c", "question": "q", "answer_prefix": "A:", "answer": ["x"], "task": "vt",
             "max_new_tokens": 8}
SCBENCH_ROW = {"id": 0, "context": "c", "multi_turns": [{"input": "q?", "answer": "a"}]}


def test_rows_keep_their_order_index_and_json_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    # a BOM, a blank line, CRLF and a U+2028 inside a string (valid JSON; str.splitlines would cut it)
    path.write_text("\ufeff" + json.dumps({"a": 1}) + "\r\n\n" + '{"a": "x\u2028y"}\n', encoding="utf-8")
    assert list(rows_with_place(path)) == [(0, 1, {"a": 1}), (1, 3, {"a": "x\u2028y"})]
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"a": 1}, {"a": 2}]))
    assert list(rows_with_place(array)) == [(0, None, {"a": 1}), (1, None, {"a": 2})]


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"a": 1}, {"a": 2}]), path)
    assert list(rows_with_place(path)) == [(0, None, {"a": 1}), (1, None, {"a": 2})]
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=rf"^{bad}: not a readable parquet file"):
        list(rows_with_place(bad))


@pytest.mark.parametrize("content, message", [
    (b'{"a": 1}\n{"a": \n', r"rows.jsonl:2: not JSON \("),
    (b"caf\xe9\n", r"rows.jsonl: not UTF-8 text \(byte 3"),
])
def test_unreadable_files_are_one_line_naming_the_place(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as info:
        list(rows_with_place(path))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("row, shown", [([1], "a JSON list"), ("x", "a JSON string"), (None, "a JSON null"),
                                        (3, "a JSON number"), (True, "a JSON boolean")])
def test_a_row_that_is_not_an_object(row, shown):
    with pytest.raises(ValueError, match=rf"^f:1: {shown}, not an object \(one row per line\)$"):
        check_object(row, "f:1")
    check_object({}, "f:1")  # an object passes


def test_missing_fields_and_wrong_types_are_named():
    with pytest.raises(ValueError, match=r"^w: no 'b', 'c' field \(expected a, b, c; it has a, z\)$"):
        check_fields({"a": 1, "z": 2}, ("a", "b", "c"), "w", expected="a, b, c")
    check_fields({"a": 1}, ("a",), "w", expected="a")
    assert str(refuse_field("w", "n", 3, "a string")) == "w: field 'n' is a number (3); expected a string"
    assert str(refuse_field("w", "n", {"k": 1}, "a list")) == "w: field 'n' is an object; expected a list"
    assert [kind(v) for v in (None, True, 1, 1.5, "s", [], {})] == [
        "null", "a boolean", "a number", "a number", "a string", "a list", "an object"]


def test_ruler_and_scbench_read_and_name_rows_through_it(tmp_path):
    ruler_file = tmp_path / "1024.jsonl"
    ruler_file.write_text(json.dumps(RULER_ROW) + "\n\n" + json.dumps([RULER_ROW]) + "\n")
    with pytest.raises(ValueError, match=rf"^{ruler_file}:3: a JSON list, not an object"):
        rd.check_local_rows(tmp_path, [1024])
    sc = tmp_path / "sc"
    sc.mkdir()
    (sc / "scbench_kv.jsonl").write_text(json.dumps(SCBENCH_ROW) + "\n\n" + json.dumps({"id": 1, "context": "c"}))
    with pytest.raises(ValueError, match=r"scbench_kv.jsonl, row 2: no 'multi_turns' field \(expected id, context"):
        sd.check_file(str(sc), "scbench_kv")
    assert [r["id"] for r in sd.load_hub_samples("scbench_kv", str(sc), limit=1)] == ["0"]


def test_scbench_refuses_a_torn_line_past_the_rows_it_checks(tmp_path):
    """check_file checks the first `limit` rows' fields but parses every line of the file, as before the shared
    reader: a torn line anywhere is refused before the model loads, not when the run reads the file."""
    (tmp_path / "scbench_kv.jsonl").write_text(json.dumps(SCBENCH_ROW) + "\n" + json.dumps(SCBENCH_ROW) + "\n"
                                                + '{"id": 2, "context": \n')
    with pytest.raises(ValueError, match=r"scbench_kv.jsonl:3: not JSON"):
        sd.check_file(str(tmp_path), "scbench_kv", limit=1)
