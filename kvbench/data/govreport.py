"""GovReport summarisation data: LongBench's ``gov_report`` (200 reports) and the full ``ccdv/govreport-summarization``.

Both loaders return summarisation records ``{"id", "document", "references", "source"}`` (LongBench ones also keep
``length``), so a runner can treat them alike.

Full test split sources (`load_govreport_full`):
- ``data_dir=None``: the hub, ``datasets.load_dataset("ccdv/govreport-summarization", split=...)`` (parquet files
  ``document/{train,validation,test}-*.parquet`` with the columns ``report`` and ``summary``);
- ``data_dir`` a local folder, searched in this order (the file names ``datasets`` maps to a split):
  ``document/<split>-*.parquet`` (a snapshot of the hub repository), ``<split>-*.parquet``, ``<split>.parquet``,
  ``<split>.jsonl`` (one JSON object per line). All need the columns ``report`` and ``summary``; an ``id`` column is
  used when present, else ids are ``govreport-<split>-<row>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from kvbench.data.hub import note_revision_read
from kvbench.data.local_rows import check_rows
from kvbench.data.longbench import load_longbench
from kvbench.errors import UserError

GOVREPORT_HUB = "ccdv/govreport-summarization"
GOVREPORT_SPLITS: tuple[str, ...] = ("train", "validation", "test")


def load_govreport_longbench(data_dir: str | Path | None = None, limit: int | None = None,
                             revision: str | None = None) -> list[dict[str, Any]]:
    """LongBench ``gov_report`` as summarisation records (document = ``context``, references = ``answers``)."""
    return [
        {
            "id": rec["_id"],
            "document": rec["context"],
            "references": list(rec["answers"]),
            "length": rec["length"],
            "source": "longbench/gov_report",
        }
        for rec in load_longbench("gov_report", data_dir=data_dir, limit=limit, revision=revision)
    ]


def _local_files(root: Path, split: str) -> tuple[str, list[Path]]:
    """The first matching file kind in ``root`` for ``split``: ("parquet" | "jsonl", sorted paths)."""
    if not root.is_dir():
        raise FileNotFoundError(f"GovReport folder not found: {root}")
    for pattern in (f"document/{split}-*.parquet", f"{split}-*.parquet", f"{split}.parquet"):
        files = sorted(root.glob(pattern))
        if files:
            return "parquet", files
    jsonl = root / f"{split}.jsonl"
    if jsonl.is_file():
        return "jsonl", [jsonl]
    raise FileNotFoundError(
        f"no GovReport {split!r} data in {root} (looked for document/{split}-*.parquet, {split}-*.parquet, "
        f"{split}.parquet, {split}.jsonl)"
    )


def check_data_dir(data_dir: Any, split: str, option: str = "task.data_dir") -> None:
    """UserError (one line) unless data_dir is a folder with the split's files (what `load_govreport_full`
    reads), each readable with `report` and `summary` text in its rows (kvbench.data.local_rows)."""
    if not str(data_dir).strip():
        raise UserError(f"invalid {option}={data_dir!r}: expected a folder with the {split!r} split "
                        f"(null: the hub)")
    try:
        _, files = _local_files(Path(data_dir).expanduser(), split)
    except FileNotFoundError as exc:
        raise UserError(f"{option}={str(data_dir)!r}: {exc}") from None
    for path in files:  # readable, rows with text in report and summary (a bad line, UTF-16, numbers: one line)
        try:
            check_rows(str(path), ("report", "summary"), ("report", "summary"))
        except UserError as exc:
            raise UserError(str(exc).replace("task.data_path file", f"{option} file", 1)) from None


def _iter_local(root: Path, split: str) -> Iterator[dict[str, Any]]:
    kind, files = _local_files(root, split)
    for path in files:
        if kind == "jsonl":
            with path.open(encoding="utf-8-sig") as fh:  # a byte order mark is not text
                for line in fh:
                    if line.strip():
                        yield json.loads(line)
        else:
            import pyarrow.parquet as pq  # lazy

            yield from pq.read_table(path).to_pylist()


def _iter_hub(split: str, hub_repo: str, revision: str | None = None) -> Iterator[dict[str, Any]]:
    import datasets  # lazy: heavy


    ds = datasets.load_dataset(hub_repo, split=split, revision=revision)
    note_revision_read(hub_repo, revision)
    yield from (dict(row) for row in ds)


def load_govreport_full(
    split: str = "test", data_dir: str | Path | None = None, limit: int | None = None, hub_repo: str = GOVREPORT_HUB,
    revision: str | None = None,
) -> list[dict[str, Any]]:
    """The full GovReport split (973 test reports on the hub, at ``revision``) as summarisation records, at most
    ``limit``."""
    if split not in GOVREPORT_SPLITS:
        raise ValueError(f"unknown GovReport split {split!r}; valid choices: {', '.join(GOVREPORT_SPLITS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    rows = _iter_local(Path(data_dir).expanduser(), split) if data_dir is not None else _iter_hub(split, hub_repo, revision)
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        if "report" not in row or "summary" not in row:
            raise ValueError(f"GovReport row {i} lacks 'report' or 'summary': keys {sorted(row)}")
        out.append(
            {
                "id": str(row.get("id") or f"govreport-{split}-{i}"),
                "document": row["report"],
                "references": [row["summary"]],
                "source": f"govreport/{split}",
            }
        )
    return out
