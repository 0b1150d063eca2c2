"""Step 1 of a run: validate every setting that needs no model, and build the method and the task.

    plan_run(cfg) -> RunPlan(settings, method, task, run_id, hashable, resolved, device, shape, setting_fields)

Checked here, before anything is loaded or written (UserError, one line, on bad input): config values
(kvbench.config.validate: storage codec resolved, budget null without eviction), the device, the model path
(kvbench.model_info), the runtime against the model's shape, the codec's options, the method (built, then its
`preflight(settings, shape)` if it has one), the task (built, then `task.preflight(settings, shape)`), and that
results_dir is writable.
"""
from __future__ import annotations

import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import OmegaConf

from kvbench import config as _config
from kvbench.errors import UserError
from kvbench.results import run_id_for


def _scalar(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return json.dumps(v, sort_keys=True, default=str)


def flat(prefix: str, values: dict) -> dict:
    """{prefix_key: scalar} (nested dicts joined with _, lists as JSON text): one pandas column per setting."""
    out = {}
    for k, v in (values or {}).items():
        if isinstance(v, dict):
            out.update(flat(f"{prefix}{k}_", v))
        else:
            out[f"{prefix}{k}"] = _scalar(v)
    return out


@dataclass
class RunPlan:
    """Everything decided before the run folder is opened."""

    settings: _config.Settings
    method: Any
    task: Any
    run_id: str
    hashable: dict
    resolved: dict  # the composed config, resolved, as written to config.yaml
    device: str
    shape: Any  # kvbench.model_info.ModelShape or None
    setting_fields: dict = field(default_factory=dict)


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"invalid model.device={device!r}: CUDA is not available here; choices: cpu, auto")
    if device == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("invalid model.device='mps': MPS is not available here; choices: cpu, auto")
    return device


def _check_runtime(rt: _config.RuntimeConfig, device: str, shape: Any, dtype: str) -> None:
    backend = rt.attention_backend
    if backend == "triton" and not device.startswith("cuda"):
        raise UserError(f"invalid runtime.attention_backend=triton on model.device={device}: "
                        f"triton needs cuda; choices here: auto, torch, cpu")
    if backend == "cpu" and device != "cpu":
        raise UserError(f"invalid runtime.attention_backend=cpu on model.device={device}: choices: auto, torch, triton")
    if shape is None:
        return
    need = shape.num_layers * shape.num_kv_heads * rt.batch_size + 1  # a block per table, and the scratch block
    if rt.num_blocks is not None and rt.num_blocks < need:
        raise UserError(f"invalid runtime.num_blocks={rt.num_blocks}: this model needs at least {need} "
                        f"({shape.num_layers} layers x {shape.num_kv_heads} kv-heads x batch {rt.batch_size} + 1)")
    if rt.num_blocks is None and rt.kv_memory_bytes is not None:
        elem = 4 if dtype == "float32" else 2
        block_bytes = 2 * rt.block_size * shape.head_dim * elem
        if rt.kv_memory_bytes // block_bytes < need:
            raise UserError(f"invalid runtime.kv_memory_bytes={rt.kv_memory_bytes}: holds "
                            f"{rt.kv_memory_bytes // block_bytes} blocks of {block_bytes} B; this model needs at "
                            f"least {need} ({need * block_bytes} bytes)")


def _check_quant(name: str, options: dict) -> None:
    """Codec name and options, checked without the model (kvquant's calibration needs it: only its settings)."""
    from kvbench.quant import registry

    names = registry.available_codecs()
    if name not in names:
        raise UserError(f"unknown quant {name!r}: choices are {', '.join(names)}{_config.did_you_mean(name, names)}")
    if hasattr(registry, "check_codec"):  # the registry validates without building (main, issue #13)
        registry.check_codec(name, dict(options))
        return
    check = getattr(registry, "validate_options", None) or getattr(registry, "_options", None)
    opts = check(name, dict(options)) if check is not None else dict(options)
    try:
        if name == "kvquant":
            registry.kvquant_settings(opts)
        elif name not in ("none", "full"):
            registry.build_codec(name, None, **options)  # cheap for kivi/int8/fp8: checks bits, group sizes...
    except UserError:
        raise
    except ValueError as exc:
        raise UserError(f"invalid settings for quant {name!r}: {exc}") from None
    except (TypeError, KeyError, AttributeError):  # a registry with other signatures: checked when built
        pass


def _build_method(build_method_fn: Callable, settings: _config.Settings) -> Any:
    """The method, given the top-level seed (a method's own `method.seed`, when set, wins)."""
    options = dict(settings.method_options)
    try:
        accepts_seed = "seed" in inspect.signature(build_method_fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        accepts_seed = False
    kwargs = {}
    if accepts_seed:
        own = options.pop("seed", None)
        kwargs["seed"] = settings.seed if own is None else own
    elif settings.method_name == "kvcrush" and options.get("seed") is None:
        options["seed"] = settings.seed  # until build_method takes the top-level seed
    if settings.compression_ratio is not None:
        kwargs["compression_ratio"] = settings.compression_ratio
    try:
        return build_method_fn(settings.method_name, settings.budget, **kwargs, **options)
    except (TypeError, ValueError) as exc:
        raise UserError(f"invalid settings for method {settings.method_name!r}: {exc}") from None


def _check_results_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvbench-probe-", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise UserError(f"results_dir={path!r} is not writable: {exc.strerror or exc}") from None


def plan_run(cfg: Any, *, build_method_fn: Optional[Callable] = None) -> RunPlan:
    """Step 1: validate every setting that needs no model and build method and task; UserError on bad input."""
    settings = _config.validate(cfg)
    device = _resolve_device(settings.model.device)
    from kvbench.model_info import check_model_path, model_shape

    check_model_path(settings.model)
    shape = model_shape(settings.model)
    _check_runtime(settings.runtime, device, shape, settings.model.dtype)
    _check_quant(settings.quant_name, settings.quant_options)
    if build_method_fn is None:
        from kvbench.methods import build_method as build_method_fn  # type: ignore[no-redef]
    method = _build_method(build_method_fn, settings)
    method_preflight = getattr(method, "preflight", None)  # e.g. a budget too small for runtime.block_size
    if callable(method_preflight):
        method_preflight(settings, shape)
    from kvbench.tasks import build_task

    task = build_task(settings.task_name, {"name": settings.task_name, **settings.task_options})
    preflight = getattr(task, "preflight", None)
    if callable(preflight):
        preflight(settings, shape)
    _check_results_dir(settings.results_dir)
    hashable = _config.hashable_config(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # what runs, in resolved form: method=kivi is recorded as method=full quant=kivi; no budget without eviction
    resolved.update(method={"name": settings.method_name, **settings.method_options},
                    quant={"name": settings.quant_name, **settings.quant_options}, budget=settings.budget,
                    compression_ratio=settings.compression_ratio)
    fields = {"model_path": settings.model.path, "model_gguf_file": settings.model.gguf_file,
              **flat("task_", settings.task_options),
              **flat("runtime_", {k: v for k, v in vars(settings.runtime).items() if k != "threads"}),
              "quant": settings.quant_name, **flat("quant_", settings.quant_options)}
    return RunPlan(settings, method, task, run_id_for(hashable), hashable, resolved, device, shape, fields)
