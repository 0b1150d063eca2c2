"""What the datasets' row checks share: reading a row file with each row's place, and the one-line refusals.

    for index, line, row in rows_with_place(path):   # parquet, a JSON array (.json) or JSON lines
        check_object(row, where)                     # "<where>: a JSON list, not an object (one row per line)"
        check_fields(row, ("context", ...), where, expected="...")   # "<where>: no 'context' field (expected ...)"
        raise refuse_field(where, "context", row["context"], "a string")  # "<where>: field 'context' is null; ..."

`index` is the row's 0-based order in the file, `line` its 1-based line for JSON lines (None otherwise); each dataset
names a row its own way from them (ruler: `file:line`, scbench: `file, row n`). Used by data/ruler.py,
data/scbench.py and data/longbench_schema.py. Every error is a ValueError whose one line names the file or row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence


def kind(value: Any) -> str:
    """A JSON value's type in words, with its article: null, a boolean, a number, a string, a list, an object."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def refuse_field(where: str, field: str, value: Any, expected: str) -> ValueError:
    """`<where>: field 'x' is a number (3); expected a string` (a scalar's value shown, cut at 40 characters)."""
    shown = kind(value) if value is None or isinstance(value, (dict, list)) else f"{kind(value)} ({value!r:.40})"
    return ValueError(f"{where}: field {field!r} is {shown}; expected {expected}")


def check_object(row: Any, where: str) -> None:
    """ValueError unless the row is a JSON object."""
    if not isinstance(row, dict):
        what = "null" if row is None else kind(row).split(" ", 1)[-1]
        raise ValueError(f"{where}: a JSON {what}, not an object (one row per line)")


def check_fields(row: dict, fields: Sequence[str], where: str, expected: str) -> None:
    """ValueError naming the fields of `fields` the row lacks, what a row holds (`expected`) and what it has."""
    missing = [f for f in fields if f not in row]
    if missing:
        raise ValueError(f"{where}: no {', '.join(map(repr, missing))} field (expected {expected}; "
                         f"it has {', '.join(map(str, row)) or 'none'})")


def rows_with_place(path: Path) -> Iterator[tuple[int, Optional[int], Any]]:
    """(index, line, row) of each row of a parquet file, a .json file holding a JSON array, or JSON lines (blank
    lines skipped, a UTF-8 BOM allowed). ValueError naming the file (and line) when it cannot be read as such."""
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # lazy (datasets brings pyarrow)

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors do not name the file
            raise ValueError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0][:120]})") from None
        for index, row in enumerate(rows):
            yield index, None, row
        return
    try:
        text = path.read_text(encoding="utf-8-sig")  # a UTF-8 BOM is not part of the first row
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8") from None
    stripped = text.lstrip()
    if path.suffix == ".json" and stripped.startswith("["):
        try:
            rows = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
        for index, row in enumerate(rows):
            yield index, None, row
        return
    index = 0
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 may stand inside a JSON string
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
        yield index, n, row
        index += 1
