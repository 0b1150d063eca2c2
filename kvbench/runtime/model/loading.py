"""Load a checkpoint (hub id, local folder, GGUF file or packaged model) into the kvbench runtime.

transformers reads weights, config and tokenizer; `build_from_transformers` copies the weights into
kvbench's own forward. A GGUF checkpoint is de-quantized once and cached as a normal
safetensors folder, keyed by the file's content, so later loads (from any checkout) take seconds.
`load_hf` first refuses a path that cannot be a model with one line (`runtime.model_files.check_model_path`), and
a checkpoint whose tensors are not its config's (transformers' load report, `kvbench.run.model_checks.loading_report`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench import atomic_write
from kvbench.console import say
from kvbench.errors import UserError, first_line
from kvbench.run.model_checks import loading_report
from kvbench.runtime.measured_times import quoted
from kvbench.runtime.backends.cpu.quant_linear import load_quant_kernel, quant_kernel_error
from kvbench.runtime.model.families import build_from_transformers, text_config
from kvbench.runtime.model.forward import LlamaFamilyModel
from kvbench.runtime.model.gguf_config import restore_rope_scaling
from kvbench.runtime.model.model_files import check_model_path, read_gguf_header, resolve_location
from kvbench.runtime.model.packaged import SMOLLM2_GGUF, cache_root, packaged_smollm2  # noqa: F401 (re-exported)
from kvbench.runtime.model.quantized_weights import WEIGHT_MODES, QuantizedWeights
from kvbench.run.spec import dtype_name

PACKAGED_GGUF = SMOLLM2_GGUF


@dataclass
class LoadedModel:
    model: LlamaFamilyModel
    tokenizer: Any
    hf_config: Any
    name: str
    dtype: torch.dtype
    device: torch.device


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from one of kvbench.run.spec.DTYPES or its short alias (fp32, bf16, fp16); UserError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, dtype_name(dtype, "dtype", aliases=True))


def load_hf(path: str, *, gguf_file: str | None = None, cache_dir: str | os.PathLike | None = None):
    """(transformers model in fp32 on cpu, tokenizer) from a hub id, local folder, GGUF file (or a folder holding one)
    or packaged model (packaged:NAME)."""
    check_model_path(path, gguf_file)
    path, gguf_file = resolve_location(path, gguf_file)
    if gguf_file is not None:
        path = str(_converted_gguf(path, gguf_file, cache_dir))
    elif path.endswith(".gguf"):
        p = Path(path).expanduser()
        path = str(_converted_gguf(str(p.parent), p.name, cache_dir))
    with quiet_transformers():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(path)
            hf, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError) as exc:
            first = first_line(exc)
            raise UserError(f"cannot load model {path!r}: {first}") from None
    mismatch = loading_report(info, f"model {path!r}")  # a tensor missing or unexpected: never random weights
    if mismatch is not None:
        raise UserError(mismatch)
    hf.eval()
    hf.kvbench_source = path  # the folder or hub id transformers loaded (a GGUF's converted folder)
    return hf, tok


@contextmanager
def quiet_transformers():
    """Keep transformers' and huggingface_hub's progress bars ("Loading weights", the GGUF conversion bar)
    out of the output while loading; restores the previous state."""
    from transformers.utils import logging as tlog

    was_enabled = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    gguf_mod = None
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_mod  # its bar is a plain tqdm.auto
        saved = gguf_mod.tqdm
        gguf_mod.tqdm = functools.partial(saved, disable=True)
    except (ImportError, AttributeError):
        gguf_mod = None
    try:
        yield
    finally:
        if gguf_mod is not None:
            gguf_mod.tqdm = saved
        if was_enabled:
            tlog.enable_progress_bar()


def load_model(path: str | None = None, *, gguf_file: str | None = None, dtype: str | torch.dtype = "float32",
               device: str = "cpu", cache_dir: str | os.PathLike | None = None,
               keep_hf: bool = False, weights: str = "dequantize") -> LoadedModel:
    """Load a checkpoint into the kvbench runtime. path=None means the packaged SmolLM2-135M-Instruct.
    weights="quantized" keeps a GGUF file's weight matrices in its own blocks (runtime.model.quantized_weights: fp32
    on CPU; elsewhere, or for a checkpoint that is not a GGUF, it changes nothing); "dequantize" reads them in fp32."""
    if weights not in WEIGHT_MODES:
        raise UserError(f"invalid model.weights={weights!r}: choices are {', '.join(WEIGHT_MODES)}")
    if path is None:
        path, gguf_file = packaged_smollm2()
    torch_dtype = resolve_dtype(dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available; use device=cpu")
    hf, tok = load_hf(path, gguf_file=gguf_file, cache_dir=cache_dir)
    quantized = None
    source = gguf_source(path, gguf_file) if weights == "quantized" else None
    if source is not None:
        if device != "cpu" or torch_dtype != torch.float32:
            say(f"kvbench: model.weights=quantized runs on the CPU in float32; de-quantizing {source.name} for "
                f"device={device}, dtype={dtype_name(torch_dtype)}")
        elif quantized_kernels_error() is not None:
            say(f"kvbench: the quantized-weight kernels are unavailable ({quantized_kernels_error()}); "
                f"de-quantizing {source.name}")
        else:
            quantized = QuantizedWeights.from_gguf(str(source), hf, text_config(hf.config))
    model = build_from_transformers(hf, dtype=torch_dtype, device=device, quantized=quantized)
    if quantized is not None:
        say(quantized.summary())
    name = getattr(hf.config, "_name_or_path", None) or str(path)
    loaded = LoadedModel(model, tok, hf.config, str(name), torch_dtype, torch.device(device))
    if keep_hf:
        loaded.hf_model = hf  # type: ignore[attr-defined]
        loaded.hf_dir = hf.kvbench_source  # type: ignore[attr-defined]
    return loaded


def gguf_source(path: str, gguf_file: str | None) -> Path | None:
    """The GGUF file a model location names (a .gguf, a folder holding one, a packaged model), or None."""
    path, gguf_file = resolve_location(path, gguf_file)
    if gguf_file is not None:
        return Path(path).expanduser() / gguf_file
    return Path(path).expanduser() if str(path).endswith(".gguf") else None


def quantized_kernels_error() -> str | None:
    """Why the quantized-weight kernels cannot run here, or None."""
    return None if load_quant_kernel() is not None else quant_kernel_error() or "unavailable"


def file_digest(src: Path, index_dir: Path) -> str:
    """sha256 of a file's content, remembered in `index_dir`/digests.json keyed by (absolute path, size, mtime),
    so a file is hashed once, not at every load."""
    st = src.stat()
    key = f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index_path = index_dir / "digests.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return index[key]
    h = hashlib.sha256()
    with open(src, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    try:  # re-read and merge: another process may have added entries meanwhile
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    index[key] = digest
    try:
        atomic_write.write_text(index_path, json.dumps(index, indent=0))
    except OSError:  # a read-only cache still works, it only hashes again next time
        pass
    return digest


def _converted_gguf(folder: str, gguf_file: str, cache_dir: str | os.PathLike | None) -> Path:
    """De-quantize a GGUF once into a safetensors folder under the cache; return that folder.

    The folder is named by the GGUF's content (sha256), so every checkout and venv on a machine that has the
    same file shares one conversion."""
    src = Path(folder).expanduser() / gguf_file
    if not src.exists():
        raise UserError(f"GGUF file {str(src)!r} does not exist")
    root = Path(cache_dir or cache_root()) / "gguf"
    out = root / f"{src.stem}-{file_digest(src, root)[:16]}"
    if (out / "done").exists():
        return out
    took = quoted("convert")
    say(f"kvbench: converting {src.name} into {out} (first use of this file on this machine, then it loads in "
        "seconds" + (f"; the packaged 135M model's {took}" if took else "") + ")")
    start = time.perf_counter()
    with atomic_write.replaced(out, folder=True) as tmp:  # an older conversion at `out` is replaced whole
        _convert_gguf(src, Path(tmp))
        say(f"kvbench: converted {src.name} in {time.perf_counter() - start:.1f} s")
        (Path(tmp) / "done").write_text(str(src))
    return out


def _convert_gguf(src: Path, dest: Path) -> None:
    """Write the de-quantized model and tokenizer of the GGUF `src` into the folder `dest` (safetensors)."""
    with quiet_transformers():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            q, info = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32,
                                                           output_loading_info=True)
        except Exception as exc:  # a corrupt or unsupported GGUF fails deep inside the reader
            first = first_line(exc)
            raise UserError(f"cannot read GGUF file {str(src)!r}: {first}") from None
        mismatch = loading_report(info, f"GGUF file {str(src)!r}", "header")  # a tensor the reader did not map: never random
        if mismatch is not None:
            raise UserError(mismatch)
        config = q.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        restore_rope_scaling(config, read_gguf_header(str(src), "model.path"))  # Gemma 3 4B+: linear x8, global
        plain = type(q)(config)  # same architecture without the GGUF quantizer attached
        plain.load_state_dict(q.state_dict())
        plain.save_pretrained(dest)
        tok.save_pretrained(dest)
