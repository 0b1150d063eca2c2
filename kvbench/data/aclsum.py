"""ACLSum papers shipped in the `aclsum` package (located without importing it: its ``__init__`` needs sienna).

Files: ``aclsum/dataset/{train,val,test}.jsonl`` (per paper: ``id``, ``title``, ``summary`` with the three human
aspect summaries ``challenge``/``approach``/``outcome``, plus sentence-level highlights) and
``aclsum/dataset/paper_jsons/<id>.json`` (S2ORC-style parse: ``abstract`` and ``pdf_parse.body_text[].text``).

Record of `load_aclsum`: ``id``, ``title``, ``document`` (body paragraphs joined by blank lines, abstract not
included), ``abstract``, ``summaries`` (aspect -> text) and ``references`` (list of reference summaries):
- ``reference="aspects"`` (default): one reference, the three aspect summaries in the order challenge, approach,
  outcome, joined by newlines (one sentence per line, so ROUGE-Lsum sees them as sentences);
- ``reference="abstract"``: the author abstract;
- ``reference="both"``: both of the above (metrics take the max over references).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from kvbench.data.essays import package_dir

SPLITS: tuple[str, ...] = ("train", "val", "test")
ASPECTS: tuple[str, ...] = ("challenge", "approach", "outcome")
REFERENCE_CHOICES: tuple[str, ...] = ("aspects", "abstract", "both")


def aclsum_dir() -> Path:
    """``aclsum/dataset`` inside the installed package."""
    path = package_dir("aclsum") / "dataset"
    if not path.is_dir():
        raise FileNotFoundError(f"ACLSum dataset folder not found: {path}")
    return path


def _root(root: str | Path | None) -> Path:
    return Path(root) if root is not None else aclsum_dir()


def load_paper(paper_id: str, root: str | Path | None = None) -> dict[str, Any]:
    """Parsed ``paper_jsons/<id>.json`` of one paper."""
    path = _root(root) / "paper_jsons" / f"{paper_id}.json"
    if not path.is_file():
        raise FileNotFoundError(f"ACLSum paper not found: {path}")
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def paper_body(paper: dict[str, Any]) -> str:
    """Body text of a parsed paper: the ``pdf_parse.body_text`` paragraphs joined by blank lines."""
    paragraphs = (p.get("text", "") for p in paper["pdf_parse"]["body_text"])
    return "\n\n".join(p for p in paragraphs if p.strip())


def aspect_reference(summaries: dict[str, str]) -> str:
    """The three aspect summaries (challenge, approach, outcome) joined by newlines."""
    return "\n".join(summaries[a].strip() for a in ASPECTS if summaries.get(a, "").strip())


def _iter_split(split: str, root: Path) -> Iterator[dict[str, Any]]:
    path = root / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"ACLSum split file not found: {path}")
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def load_aclsum(
    split: str = "test", limit: int | None = None, reference: str = "aspects", root: str | Path | None = None
) -> list[dict[str, Any]]:
    """Papers of one ACLSum split (file order), at most ``limit``, with body, abstract and references."""
    if split not in SPLITS:
        raise ValueError(f"unknown ACLSum split {split!r}; valid choices: {', '.join(SPLITS)}")
    if reference not in REFERENCE_CHOICES:
        raise ValueError(f"unknown reference {reference!r}; valid choices: {', '.join(REFERENCE_CHOICES)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    base = _root(root)
    records: list[dict[str, Any]] = []
    for row in _iter_split(split, base):
        if limit is not None and len(records) >= limit:
            break
        paper = load_paper(row["id"], base)
        summaries = {a: row["summary"][a] for a in ASPECTS}
        abstract = paper.get("abstract") or ""
        refs = {"aspects": [aspect_reference(summaries)], "abstract": [abstract]}
        refs["both"] = refs["aspects"] + refs["abstract"]
        records.append(
            {
                "id": row["id"],
                "title": row.get("title") or paper.get("title", ""),
                "document": paper_body(paper),
                "abstract": abstract,
                "summaries": summaries,
                "references": refs[reference],
            }
        )
    return records


def load_aclsum_bodies(root: str | Path | None = None) -> list[tuple[str, str]]:
    """``(id, body)`` for every paper under ``paper_jsons`` (all splits), sorted by id (the file name)."""
    files = sorted((_root(root) / "paper_jsons").glob("*.json"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no paper JSON files under {_root(root) / 'paper_jsons'}")
    out = []
    for f in files:
        with f.open(encoding="utf-8") as fh:
            out.append((f.stem, paper_body(json.load(fh))))
    return out


def aclsum_corpus_text(root: str | Path | None = None) -> str:
    """All paper bodies sorted by id, joined by blank lines (a perplexity corpus)."""
    return "\n\n".join(body for _, body in load_aclsum_bodies(root))
