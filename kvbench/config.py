"""Config schemas (dataclasses) for `python -m kvbench`, registered in Hydra's ConfigStore.

The schemas are stored at the root of the ConfigStore under `kvbench_*` names, not inside the `model/`,
`task/`, ... groups, so they never show up as choices in `--help`. conf/config.yaml extends `kvbench_schema`;
conf/task/perplexity.yaml extends `kvbench_task_perplexity` (tasks.perplexity.PerplexityOptions: a task's options
dataclass is its schema).

Hydra checks types when it composes (budget=abc is refused there); `validate()` checks values (budget=-5) and
turns a DictConfig into these dataclasses, raising UserError with the bad value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from kvbench.errors import UserError
from tasks.perplexity import PerplexityOptions

DTYPES = ("float32", "bfloat16", "float16")
LOGGER_MODES = ("auto", "online", "offline", "disabled")


def _check_positive(where: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or null" if allow_none else "")
        raise UserError(f"invalid {where}={value!r}: expected {allowed}")


@dataclass
class ModelConfig:
    name: Optional[str] = "smollm2-135m"
    path: Optional[str] = None  # hub id or local folder; None = the packaged SmolLM2 GGUF
    gguf_file: Optional[str] = None
    dtype: str = "float32"
    device: str = "cpu"
    cache_dir: Optional[str] = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise UserError(f"invalid model.dtype={self.dtype!r}: choices are {', '.join(DTYPES)}")
        dev = str(self.device)
        if not (dev in ("cpu", "cuda", "mps", "auto") or dev.startswith("cuda:")):
            raise UserError(f"invalid model.device={dev!r}: choices are cpu, cuda, cuda:N, mps, auto")
        if self.name is None and self.path is None:
            raise UserError("model=hf needs model.path=<hub id or local folder>")
        if self.name is None:
            self.name = os.path.basename(os.path.normpath(self.path)) if self.path else "unnamed"


@dataclass
class RuntimeConfig:
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_memory_bytes: Optional[int] = None
    prefill_chunk_size: int = 512
    batch_size: int = 1
    attention_backend: str = "auto"
    threads: Optional[int] = None

    def __post_init__(self) -> None:
        _check_positive("runtime.block_size", self.block_size)
        _check_positive("runtime.num_blocks", self.num_blocks, allow_none=True)
        _check_positive("runtime.kv_memory_bytes", self.kv_memory_bytes, allow_none=True)
        _check_positive("runtime.prefill_chunk_size", self.prefill_chunk_size)
        _check_positive("runtime.batch_size", self.batch_size)
        _check_positive("runtime.threads", self.threads, allow_none=True)


@dataclass
class LoggerConfig:
    wandb: bool = True
    project: str = "kvbench"
    entity: Optional[str] = None
    mode: str = "auto"
    log_samples: bool = True

    def __post_init__(self) -> None:
        if self.mode not in LOGGER_MODES:
            raise UserError(f"invalid logger.mode={self.mode!r}: choices are {', '.join(LOGGER_MODES)}")


@dataclass
class KvbenchConfig:
    """The root of a run's config. `method` and `task` are free-form: each method/task validates its options."""

    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = None
    quant: Any = None
    task: Any = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    budget: Optional[int] = None
    seed: int = 0
    results_dir: str = "results"
    rerun: bool = False
    progress: bool = True


@dataclass
class Settings:
    """The validated, typed view of a run's config (what app.run works from)."""

    model: ModelConfig
    runtime: RuntimeConfig
    logger: LoggerConfig
    method_name: str
    method_options: dict
    quant_name: str
    quant_options: dict
    task_name: str
    task_options: dict
    budget: Optional[int]
    seed: int
    results_dir: str
    rerun: bool
    progress: bool


def _section(cfg: Any, key: str) -> dict:
    node = cfg.get(key) if hasattr(cfg, "get") else None
    if node is None:
        return {}
    if OmegaConf.is_config(node):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    return dict(node)


def _build(cls: type, where: str, values: dict) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise UserError(f"unknown option {where}.{unknown[0]}: valid options are {', '.join(names)}")
    return cls(**values)


def validate(cfg: Any) -> Settings:
    """Check a composed run config and return it typed; raises UserError naming the bad value."""
    method = _section(cfg, "method")
    task = _section(cfg, "task")
    if not method.get("name"):
        raise UserError("method.name is missing: every method YAML needs `name:` (see conf/method/)")
    if not task.get("name"):
        raise UserError("task.name is missing: every task YAML needs `name:` (see conf/task/)")
    budget = cfg.get("budget")
    _check_positive("budget", budget, allow_none=True)
    seed = cfg.get("seed", 0)
    _check_positive("seed", seed, minimum=0)
    model = _section(cfg, "model")
    quant = _section(cfg, "quant") or {"name": "none"}
    return Settings(
        model=_build(ModelConfig, "model", model),
        runtime=_build(RuntimeConfig, "runtime", _section(cfg, "runtime")),
        logger=_build(LoggerConfig, "logger", _section(cfg, "logger")),
        method_name=str(method.pop("name")),
        method_options=method,
        quant_name=str(quant.pop("name", "none")),
        quant_options=quant,
        task_name=str(task.pop("name")),
        task_options=task,
        budget=budget,
        seed=int(seed),
        results_dir=os.path.abspath(os.path.expanduser(str(cfg.get("results_dir", "results")))),
        rerun=bool(cfg.get("rerun", False)),
        progress=bool(cfg.get("progress", True)),
    )


def hashable_config(root: Any) -> dict:
    return {k: (OmegaConf.to_container(root[k], resolve=True) if OmegaConf.is_config(root[k]) else root[k])
            for k in ("model", "method", "quant", "task", "runtime", "budget", "seed") if k in root}


def _resolve_run_id(*, _root_: DictConfig) -> str:
    from kvbench.results import run_id_for

    return run_id_for(hashable_config(_root_))


def _resolve_run_dir(*, _root_: DictConfig) -> str:
    results_dir = os.path.expanduser(str(_root_.results_dir))
    return os.path.join(results_dir, _resolve_run_id(_root_=_root_))


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="kvbench_schema", node=KvbenchConfig)
    cs.store(name="kvbench_task_perplexity", node=PerplexityOptions)
    OmegaConf.register_new_resolver("kvbench_run_id", _resolve_run_id, replace=True)
    OmegaConf.register_new_resolver("kvbench_run_dir", _resolve_run_dir, replace=True)


register()
