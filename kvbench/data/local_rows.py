"""Checks of a local data file before the model loads: readable, not empty, well formed, with the task's columns.

`check_rows(path, columns)` raises UserError with one line naming the file and what is wrong:

    task.data_path file /d/test.jsonl is empty
    task.data_path file /d/test.jsonl, line 3: not JSON (Expecting ',' delimiter)
    task.data_path file /d/test.jsonl, line 1: no 'answer' column (expected question, answer; it has question, id)

jsonl / json rows are parsed here (a .json file is a JSON array of objects, one object, or JSON lines, as
`datasets`' json builder reads them); csv is read for its header; parquet and arrow for their schema (pyarrow, which
`datasets` brings). Only the first MAX_CHECKED_BYTES of a large JSON lines file are parsed (its first rows are
checked; a large JSON array is checked for its opening bracket only).
"""
from __future__ import annotations

import csv
import json
import os
from typing import Any, Iterable, Optional

from kvbench.errors import UserError, first_line

MAX_CHECKED_BYTES = 64 << 20


def _refuse(path: str, what: str, line: Optional[int] = None) -> UserError:
    where = f"task.data_path file {path}" + (f", line {line}" if line is not None else "")
    return UserError(f"{where}: {what}")


def _check_columns(path: str, keys: Iterable[str], columns: tuple[str, ...], line: Optional[int] = None) -> None:
    keys = list(keys)
    missing = [c for c in columns if c not in keys]
    if missing:
        raise _refuse(path, f"no {', '.join(map(repr, missing))} column{'s' if len(missing) > 1 else ''} "
                            f"(expected {', '.join(columns)}; it has {', '.join(keys) or 'none'})", line)


def _check_object(path: str, row: Any, columns: tuple[str, ...], line: Optional[int],
                  strings: tuple[str, ...] = ()) -> None:
    if not isinstance(row, dict):
        raise _refuse(path, f"a JSON {type(row).__name__}, not an object (one row per line: {{\"column\": value}})",
                      line)
    _check_columns(path, row, columns, line)
    for column in strings:
        value = row.get(column)
        if column in row and not isinstance(value, str):
            shown = "null" if value is None else f"a JSON {type(value).__name__} ({json.dumps(value)[:40]})"
            raise _refuse(path, f"column {column!r} is {shown}; expected text", line)


def _check_json_lines(path: str, text: str, columns: tuple[str, ...], truncated: bool,
                      strings: tuple[str, ...] = ()) -> None:
    lines = text.splitlines()
    if truncated and lines:
        lines = lines[:-1]  # the last line read may be cut off
    rows = 0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise _refuse(path, f"not JSON ({getattr(exc, 'msg', str(exc))}, column {getattr(exc, 'colno', '?')})",
                          n) from None
        _check_object(path, row, columns, n, strings)
        rows += 1
    if not rows:
        raise _refuse(path, "holds no rows (only blank lines)")


def _check_json(path: str, text: str, columns: tuple[str, ...], truncated: bool,
                strings: tuple[str, ...] = ()) -> None:
    head = text.lstrip()
    if head.startswith("[") and truncated:
        return  # a large JSON array: parsed by `datasets` when the run reads it
    if head.startswith("["):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _refuse(path, f"not JSON ({getattr(exc, 'msg', str(exc))})", getattr(exc, "lineno", None)) from None
        if not data:
            raise _refuse(path, "holds an empty JSON array (no rows)")
        for row in data:
            _check_object(path, row, columns, None, strings)
        return
    _check_json_lines(path, text, columns, truncated, strings)


def _check_csv(path: str, columns: tuple[str, ...]) -> None:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise _refuse(path, "has no header line")
        if next(reader, None) is None:
            raise _refuse(path, "has a header but no rows")
    _check_columns(path, header, columns, 1)


def _check_arrow_schema(path: str, parquet: bool, columns: tuple[str, ...], strings: tuple[str, ...] = ()) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - datasets brings pyarrow
        return
    try:
        if parquet:
            schema = pq.read_schema(path)
        else:
            try:
                schema = pa.ipc.open_stream(path).schema
            except pa.ArrowInvalid:
                schema = pa.ipc.open_file(path).schema
        names = schema.names
    except Exception as exc:  # pyarrow's own errors: not a parquet / arrow file
        raise _refuse(path, f"cannot be read as {'parquet' if parquet else 'arrow'} ({first_line(exc)})") from None
    _check_columns(path, names, columns)
    for column in strings:
        if column in names:
            kind = schema.field(column).type
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise _refuse(path, f"column {column!r} holds {kind}, not text; expected text")


def check_rows(path: str, columns: tuple[str, ...] = (), string_columns: tuple[str, ...] = ()) -> None:
    """UserError (one line naming `path`) unless the file is readable, not empty, well formed, every row has
    `columns` and text (a string) in each of `string_columns`. A UTF-8 byte order mark is allowed (the readers
    drop it); UTF-16 is refused."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            raise _refuse(path, "is empty" + (f" (expected rows with {', '.join(columns)})" if columns else ""))
        ext = os.path.splitext(path)[1].lower()
        if ext in (".parquet", ".arrow"):
            _check_arrow_schema(path, ext == ".parquet", columns, string_columns)
            return
        if ext == ".csv":
            _check_csv(path, columns)
            return
        with open(path, "rb") as f:
            data = f.read(MAX_CHECKED_BYTES)
    except OSError as exc:
        raise _refuse(path, f"cannot be read: {exc.strerror or exc}") from None
    truncated = size > len(data)
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise _refuse(path, f"is UTF-16 text (byte order mark {data[:2].hex()}); expected UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if not truncated or exc.start < len(data) - 4:
            raise _refuse(path, f"is not UTF-8 text (byte {exc.start})") from None
        text = data[:exc.start].decode("utf-8-sig")
    if not text.strip():
        raise _refuse(path, "holds only whitespace" + (f" (expected rows with {', '.join(columns)})" if columns else ""))
    if ext == ".jsonl":
        _check_json_lines(path, text, columns, truncated, string_columns)
    else:
        _check_json(path, text, columns, truncated, string_columns)
