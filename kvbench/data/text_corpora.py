"""Plain-text corpora for perplexity: a local text file, WikiText-2 and PG-19.

The hub datasets are read through `datasets` (imported lazily), either from the hub or from a local copy in the
hub's own layout (`data_path`: a folder or a single parquet / jsonl / json / arrow / csv file):

- wikitext: `Salesforce/wikitext`, config `wikitext-2-raw-v1`, one line of text per row in column `text`;
  the corpus is the usual "\\n\\n".join of the split's rows.
- pg19: `emozilla/pg19-test` (split `test`), one book per row: `short_book_title`, `publication_date`, `url`,
  `text`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Optional

from kvbench.data.hub import note_revision_read, require_hub
from kvbench.data.local_rows import check_rows
from kvbench.run.data_digest import visible_files
from kvbench.errors import UserError, first_line

WIKITEXT_HUB_ID = "Salesforce/wikitext"
WIKITEXT_CONFIG = "wikitext-2-raw-v1"
PG19_HUB_ID = "emozilla/pg19-test"

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}


def check_text_file(path: str) -> Path:
    """The path of a readable UTF-8 text file; UserError (one line) for a missing, binary or non-UTF-8 file."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_file():
        what = "is not a regular file" if p.exists() else "no such file"
        raise UserError(f"task.text_file={str(path)!r}: {what}: expected a UTF-8 text file")
    data = p.read_bytes()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise UserError(f"task.text_file={str(path)!r} is UTF-16 text (byte order mark {data[:2].hex()}): "
                        f"convert it to UTF-8, e.g. iconv -f utf-16 -t utf-8")
    if b"\x00" in data[:65536]:
        raise UserError(f"task.text_file={str(path)!r} is a binary file (NUL bytes): give a UTF-8 text file")
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte order mark is not text: dropped
    except UnicodeDecodeError as exc:
        raise UserError(f"task.text_file={str(path)!r} is not UTF-8 text (byte {exc.start}): "
                        f"convert it, e.g. iconv -f latin1 -t utf-8") from None
    if not text.strip():
        what = "is empty" if not data else "holds only whitespace"
        raise UserError(f"task.text_file={str(path)!r} {what}: expected a UTF-8 text file with text to score")
    return p


def load_text_file(path: str) -> str:
    """The text of a local UTF-8 text file, without a leading byte order mark (binary or other encodings are
    refused: check_text_file)."""
    return check_text_file(path).read_text(encoding="utf-8-sig")


def check_data_path(data_path: str, split: str, config: Optional[str] = None,
                    columns: tuple[str, ...] = (), string_columns: tuple[str, ...] = ()) -> None:
    """UserError (one line) unless data_path is a local copy with the split's files (see _local_files), each one
    readable, not empty, and (jsonl / json / csv / parquet) with every one of `columns` in each row, and text in
    each of `string_columns` (kvbench.data.local_rows)."""
    _, files = _local_files(data_path, split, config)
    for path in files:
        check_rows(path, columns, string_columns)


def _local_files(data_path: str, split: str, config: Optional[str]) -> tuple[str, list[str]]:
    """(datasets builder, files) for a local copy of a hub dataset: a single file, or the split's files in a
    folder (files named `<split>-*.ext`, `<split>.ext`, or under a `<split>/` folder; preferring those under a
    folder named after the config, e.g. wikitext-2-raw-v1/)."""
    if not str(data_path).strip():
        raise UserError(f"invalid task.data_path={str(data_path)!r}: expected a folder or a "
                        f"{'/'.join(sorted(_BUILDERS))} file (null: the hub)")
    root = Path(os.path.expanduser(str(data_path)))
    if not root.exists():
        raise UserError(f"task.data_path={str(data_path)!r}: no such file or folder")
    if not (root.is_file() or root.is_dir()):
        raise UserError(f"task.data_path={str(data_path)!r} is not a regular file or folder")
    if root.is_file():
        builder = _BUILDERS.get(root.suffix.lower())
        if builder is None:
            raise UserError(f"task.data_path={str(data_path)!r}: unsupported file type "
                            f"(choices: {', '.join(sorted(_BUILDERS))})")
        return builder, [str(root)]
    found = visible_files(root, tuple(_BUILDERS))  # hidden files skipped, as the run's digest skips them

    def in_split(p: Path) -> bool:
        rel = p.relative_to(root)
        return (p.stem == split or p.name.startswith(split + "-") or p.name.startswith(split + ".")
                or split in rel.parts[:-1])

    matches = [p for p in found if in_split(p)]
    if config:
        preferred = [p for p in matches if config in p.relative_to(root).parts[:-1]]
        matches = preferred or matches
    if not matches:
        raise UserError(f"task.data_path={str(data_path)!r}: no {split!r} split files "
                        f"(expected {split}-*.parquet, {split}.jsonl, ... inside)")
    builders = {_BUILDERS[p.suffix.lower()] for p in matches}
    if len(builders) > 1:
        ext = matches[0].suffix.lower()
        matches = [p for p in matches if p.suffix.lower() == ext]
    return _BUILDERS[matches[0].suffix.lower()], [str(p) for p in matches]


def load_hub_dataset(hub_id: str, config: Optional[str], split: str, data_path: Optional[str] = None,
                     revision: Optional[str] = None) -> Any:
    """A `datasets.Dataset` from a local copy (data_path) or the hub at `revision` (null: the default branch; the
    commit read is recorded, kvbench.data.hub.revisions_read); UserError when it cannot be had."""
    try:
        import datasets
    except ImportError:
        raise UserError("the `datasets` package is needed for hub corpora: pip install datasets") from None
    if data_path is not None:
        builder, files = _local_files(data_path, split, config)
        try:
            return datasets.load_dataset(builder, data_files={split: files}, split=split)
        except Exception as exc:
            raise UserError(f"cannot read task.data_path={str(data_path)!r}: {first_line(exc)}") from None
    require_hub(f"dataset {hub_id!r}", "task.data_path")  # fail at once offline, not after the hub's retries
    try:
        ds = datasets.load_dataset(hub_id, config, split=split, revision=revision) if config else \
            datasets.load_dataset(hub_id, split=split, revision=revision)
    except Exception as exc:
        raise UserError(f"cannot load dataset {hub_id!r} (split {split!r}) from the hub: "
                        f"{first_line(exc)}; "
                        f"pass task.data_path=<local copy> to read it from disk") from None
    note_revision_read(hub_id, revision)
    return ds


def _column(ds: Any, name: str, where: str) -> list:
    if name not in ds.column_names:
        raise UserError(f"{where}: no {name!r} column (columns: {', '.join(ds.column_names)})")
    return ds[name]


def load_wikitext(data_path: Optional[str] = None, split: str = "test", config: str = WIKITEXT_CONFIG,
                  revision: Optional[str] = None) -> str:
    """WikiText-2 (raw) as one string: the split's rows joined by "\\n\\n" (the usual perplexity setup)."""
    ds = load_hub_dataset(WIKITEXT_HUB_ID, config, split, data_path, revision)
    return "\n\n".join(_column(ds, "text", "wikitext"))


def iter_pg19(data_path: Optional[str] = None, split: str = "test",
              revision: Optional[str] = None) -> Iterator[tuple[str, str]]:
    """(id, text) per PG-19 book, in dataset order; id is the short book title (or the row number)."""
    ds = load_hub_dataset(PG19_HUB_ID, None, split, data_path, revision)
    _column(ds, "text", "pg19")
    has_title = "short_book_title" in ds.column_names
    for i, row in enumerate(ds):
        title = row.get("short_book_title") if has_title else None
        yield (str(title) if title else f"pg19-{i}"), row["text"]
