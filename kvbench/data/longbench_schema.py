"""The types of a LongBench row, checked before it is scored: a malformed row is refused, never scored silently.

    check_record(raw, where) -> None, or ValueError("<where>: field 'context' is null; expected a string")

`where` names the row (`/d/narrativeqa.jsonl:3`, or the hub dataset and row number). The official rows hold
(THUDM/LongBench's data.zip): `input` (str), `context` (str), `answers` (a list of str), `length` (int),
`dataset` (str), `language` (str), `all_classes` (null or a list of str), `_id` (str). Without this check
`"context": null` put the word "None" into the prompt and `"answers": {"a": "0"}` became the reference ['a'].
`answers` may also be one string (a list of one); `input`, `length`, `dataset`, `language`, `all_classes` and `_id`
may be absent (filled with their defaults), never of another type.
"""
from __future__ import annotations

from typing import Any

from kvbench.data.row_checks import check_object, refuse_field as _refuse

REQUIRED = ("context", "answers")


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def check_record(raw: Any, where: str) -> None:
    """ValueError naming `where` and the first field whose type is not LongBench's (see the module docstring)."""
    check_object(raw, where)
    missing = [f for f in REQUIRED if f not in raw]
    if missing:
        raise ValueError(f"{where}: no {' or '.join(map(repr, missing))} field (it has {', '.join(sorted(raw))})")
    if not isinstance(raw["context"], str):
        raise _refuse(where, "context", raw["context"], "a string")
    answers = raw["answers"]
    if not (isinstance(answers, str) or (_str_list(answers) and answers)):
        raise _refuse(where, "answers", answers, "a non-empty list of strings")
    for field in ("input", "dataset", "language"):
        if field in raw and not isinstance(raw[field], str):
            raise _refuse(where, field, raw[field], "a string")
    if raw.get("_id") is not None and not isinstance(raw["_id"], str):
        raise _refuse(where, "_id", raw["_id"], "a string or null")
    if raw.get("all_classes") is not None and not _str_list(raw["all_classes"]):
        raise _refuse(where, "all_classes", raw["all_classes"], "null or a list of strings")
    length = raw.get("length")
    whole = isinstance(length, int) or (isinstance(length, float) and length.is_integer())
    if length is not None and (isinstance(length, bool) or not whole or length < 0):
        raise _refuse(where, "length", length, "a whole number or null")
