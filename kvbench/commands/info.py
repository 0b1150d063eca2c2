"""`kvbench-info MODEL [--dtype DTYPE]`: what kvbench knows about a model before loading it, from its config.json
(a local folder, a cached hub model, or a conf/model preset's name) or its GGUF header (read as transformers' GGUF
reader reads it: kvbench.runtime.model.gguf_config): its layer types (full / sliding(window)) and the KV bytes one
token costs (kvbench.run.model_info.kv_bytes_per_token). Nothing is loaded or downloaded.

    kvbench-info gemma-3-1b                 # a preset of conf/model (its hub id must be in the local cache)
    kvbench-info /path/to/model --dtype bfloat16
    kvbench-info /path/to/gemma-3-270m-q4_k_m.gguf
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from kvbench.errors import UserError
from kvbench.run.model_info import check_runnable, describe_shape, model_shape
from kvbench.runtime.model.model_files import check_model_path, resolve_location
from kvbench.run.spec import dtype_name

PRESETS = Path(__file__).resolve().parents[2] / "conf" / "model"


def resolve(model: str) -> tuple[str | None, str, str | None]:
    """(model.path, dtype, gguf_file) of a preset name or a path / hub id (dtype float32 unless the preset says)."""
    preset = PRESETS / f"{model}.yaml"
    if preset.is_file() and not os.path.exists(model):
        import yaml

        cfg = yaml.safe_load(preset.read_text()) or {}
        return cfg.get("path"), str(cfg.get("dtype") or "float32"), cfg.get("gguf_file")
    return model, "float32", None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvbench-info", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a conf/model preset name, a local model folder or .gguf file, or a cached hub id")
    ap.add_argument("--dtype", default=None, help="the KV dtype (default: the preset's, else float32)")
    args = ap.parse_args(argv)
    try:
        path, dtype, gguf = resolve(args.model)
        dtype = dtype_name(args.dtype or dtype, "--dtype", aliases=True)
        if path is not None:
            check_model_path(path, gguf)
            path, gguf = resolve_location(path, gguf)  # a packaged model, or a folder holding one .gguf
            check_runnable(SimpleNamespace(path=path, gguf_file=gguf))  # a GGUF of another family: one line
        shape = model_shape(SimpleNamespace(path=path, gguf_file=gguf))
        if shape is None:
            raise UserError(f"model {args.model!r}: its config.json is not on this machine (a hub model is read from "
                            f"the local Hugging Face cache only: download it first)")
    except UserError as exc:
        print(f"kvbench-info: {exc}", file=sys.stderr)
        return 2
    shown = os.path.join(str(path), gguf) if path and gguf else path  # the GGUF file itself, where one is read
    print(f"model: {args.model}" + (f" ({shown})" if shown and shown != args.model else ""))
    for line in describe_shape(shape, dtype):
        print(line)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
