"""Config schemas (dataclasses) for `python -m kvbench`, registered in Hydra's ConfigStore.

The schemas are stored at the root of the ConfigStore under `kvbench_*` names, not inside the `model/`,
`task/`, ... groups, so they never show up as choices in `--help`. conf/config.yaml extends `kvbench_schema`.
Task options have no Hydra schema: each task validates its own (tasks.build_task), so this module imports no task.

Hydra checks types when it composes (budget=abc is refused there); `validate()` checks values (budget=-5, unknown
top-level keys added with `+`), resolves the storage codec (`method=kivi` = `method=full quant=kivi`) and turns a
DictConfig into these dataclasses, raising UserError with the bad value and what is allowed. What the values mean
(storage resolution, budget and compression_ratio, the hashed config that names a run) is kvbench.run.spec's.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kvbench.errors import UserError, first_line
from kvbench.registry import did_you_mean
from kvbench.run.spec import (ATTENTION_BACKENDS, PREEMPTION_MODES, RUNTIME_COUNT_MAX, SCHEDULES, SEED_MAX,
                          SPECULATIVE_MAX_TOKENS, check_bool, check_budget, check_compression, check_positive,
                          check_question_source, check_retrieval_storage, check_rewrite_storage, check_task_counts,
                          check_threshold, dtype_name, hashable_config, kept_budget, normalise_runtime, normalise_task,
                          raw_value, resolve_storage, results_path)
from kvbench.store.naming import model_label, run_id_for

LOGGER_MODES = ("auto", "online", "offline", "disabled")
WEIGHT_MODES = ("quantized", "dequantize")  # runtime.model.quantized_weights.WEIGHT_MODES (the runtime sits below)
QUANT_ACTIVATIONS = ("fp32", "q8")  # backends.cpu.quant_linear.ACTIVATIONS
BLOCK_SIZE_MAX = 4096  # tokens per KV block


@dataclass
class ModelConfig:
    name: Optional[str] = "smollm2-135m"
    path: Optional[str] = None  # hub id or local folder; None = the packaged SmolLM2 GGUF
    gguf_file: Optional[str] = None
    dtype: str = "float32"
    device: str = "cpu"
    cache_dir: Optional[str] = None
    # a GGUF's weight matrices: kept in the file's blocks (CPU kernels) or de-quantized to fp32 (runtime.model.loading)
    weights: str = "quantized"
    # the activations of decode products with weights kept quantized: fp32, or q8 (rows quantized to Q8_0 blocks for
    # integer dot products with Q8_0 / Q4_0 / Q5_0 / Q4_K / Q6_K weights, as llama.cpp; runtime.model.quantized_weights)
    quant_activations: str = "fp32"

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if self.weights not in WEIGHT_MODES:
            raise UserError(f"invalid model.weights={self.weights!r}: choices are {', '.join(WEIGHT_MODES)}")
        if self.quant_activations not in QUANT_ACTIVATIONS:
            raise UserError(f"invalid model.quant_activations={self.quant_activations!r}: choices are "
                            f"{', '.join(QUANT_ACTIVATIONS)}")
        dev = str(self.device)
        if not (dev in ("cpu", "cuda", "mps", "auto") or dev.startswith("cuda:")):
            raise UserError(f"invalid model.device={dev!r}: choices are cpu, cuda, cuda:N, mps, auto")
        if self.name is None and self.path is None:
            raise UserError("model=hf needs model.path=<hub id or local folder>")
        if self.path is not None and not str(self.path).strip():
            raise UserError("invalid model.path='': expected a hub id or a local folder")
        self.name = model_label(dataclasses.asdict(self)) if (self.path or self.name) else "unnamed"


@dataclass
class SpeculativeConfig:
    """runtime.speculative: speculative decoding (kvbench.runtime.serving.speculative); off while num_tokens is 0."""

    num_tokens: int = 0  # draft tokens per round, k (0 = off)
    draft: str = "self"  # self: the target model over a compressed draft cache; or a model (path / hub id), same tokenizer
    method: str = "streaming_llm"  # the draft cache's method (any kvbench method or codec name)
    budget: Optional[int] = 256  # the draft method's budget (KV tokens per sequence, layer and kv-head)
    adaptive: bool = False  # shrink k when under half the drafts are accepted, grow it when all are

    def __post_init__(self) -> None:
        check_positive("runtime.speculative.num_tokens", self.num_tokens, minimum=0, maximum=SPECULATIVE_MAX_TOKENS)
        check_positive("runtime.speculative.budget", self.budget, allow_none=True)
        check_bool("runtime.speculative.adaptive", self.adaptive)
        if not isinstance(self.draft, str) or not self.draft.strip():
            raise UserError(f"invalid runtime.speculative.draft={self.draft!r}: expected self or a model path / hub id")
        if not isinstance(self.method, str) or not self.method:
            raise UserError(f"invalid runtime.speculative.method={self.method!r}: expected a method name")

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


@dataclass
class RuntimeConfig:
    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_memory_bytes: Optional[int] = None
    prefill_chunk_size: int = 512
    batch_size: int = 1
    attention_backend: str = "auto"
    threads: Optional[int] = None  # a pure performance knob: not part of the run id
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    admission_watermark: float = 0.01
    schedule: str = "mixed"  # mixed (vLLM v1: decodes first, prefill chunks fill the token budget) | prefill_first
    prefix_caching: Any = "auto"  # auto (on for methods that allow it) | true | false
    preemption: str = "recompute"  # recompute | swap (blocks to host memory) | auto (the cheaper of the two)
    swap_bytes: Optional[int] = None  # host swap space in bytes (null: as large as the KV pool)
    speculative: Any = field(default_factory=SpeculativeConfig)
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs on CUDA (ignored elsewhere); not in the run id
    # ranks one model is sharded over (a torchrun launch; kvbench/runtime/model/tensor_parallel.py)
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict) or self.speculative is None:
            self.speculative = _build(SpeculativeConfig, "runtime.speculative", dict(self.speculative or {}))
        elif not isinstance(self.speculative, SpeculativeConfig):  # runtime.speculative=abc: a section, not a value
            names = ", ".join(f.name for f in dataclasses.fields(SpeculativeConfig))
            raise UserError(f"invalid runtime.speculative={self.speculative!r}: expected its options "
                            f"(runtime.speculative.<option>=...: {names})")
        if self.preemption not in PREEMPTION_MODES:
            raise UserError(f"invalid runtime.preemption={self.preemption!r}: choices are {', '.join(PREEMPTION_MODES)}"
                            f"{did_you_mean(str(self.preemption), PREEMPTION_MODES)}")
        check_positive("runtime.swap_bytes", self.swap_bytes, allow_none=True, minimum=0)
        if self.schedule not in SCHEDULES:
            raise UserError(f"invalid runtime.schedule={self.schedule!r}: choices are {', '.join(SCHEDULES)}")
        check_bool("runtime.cuda_graphs", self.cuda_graphs)
        if self.prefix_caching not in ("auto", True, False):
            raise UserError(f"invalid runtime.prefix_caching={self.prefix_caching!r}: choices are auto, true, false")
        check_positive("runtime.block_size", self.block_size, maximum=BLOCK_SIZE_MAX)
        check_positive("runtime.tensor_parallel", self.tensor_parallel, maximum=1024)
        check_positive("runtime.num_blocks", self.num_blocks, allow_none=True, minimum=2)
        check_positive("runtime.kv_memory_bytes", self.kv_memory_bytes, allow_none=True)
        for key, most in RUNTIME_COUNT_MAX.items():
            check_positive(f"runtime.{key}", getattr(self, key), maximum=most)
        check_positive("runtime.threads", self.threads, allow_none=True, maximum=max(1024, os.cpu_count() or 1))
        w = self.admission_watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < 1:
            raise UserError(f"invalid runtime.admission_watermark={w!r}: expected a number in [0, 1)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise UserError(f"invalid runtime.attention_backend={self.attention_backend!r}: choices are "
                            f"{', '.join(ATTENTION_BACKENDS)}{did_you_mean(self.attention_backend, ATTENTION_BACKENDS)}")


@dataclass
class LoggerConfig:
    wandb: bool = True
    project: str = "kvbench"
    entity: Optional[str] = None
    mode: str = "auto"
    log_samples: bool = True
    init_timeout_s: float = 30.0  # longest wait for W&B to start online; then the run logs offline

    def __post_init__(self) -> None:
        if self.mode not in LOGGER_MODES:
            raise UserError(f"invalid logger.mode={self.mode!r}: choices are {', '.join(LOGGER_MODES)}")
        t = self.init_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise UserError(f"invalid logger.init_timeout_s={t!r}: expected seconds in (0, 3600]")


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
    compression_ratio: Optional[float] = None  # kvpress's knob, exclusive with budget (see check_compression)
    seed: int = 0
    results_dir: str = "results"
    rerun: bool = False
    progress: bool = True
    experiment: Optional[str] = None  # set by conf/experiment/<name>.yaml; W&B group, recorded in metrics.json
    paper: Any = None  # conf/experiment/<name>.yaml: the published values (read by kvbench-report; not hashed)


ROOT_KEYS = tuple(f.name for f in dataclasses.fields(KvbenchConfig))


def bool_keys(cls: type = None, prefix: str = "") -> set:
    """The dotted names of the schema's true/false settings (runtime.cuda_graphs, rerun, logger.wandb, ...)."""
    out = set()
    for f in dataclasses.fields(cls or KvbenchConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.type in ("bool", bool):
            out.add(prefix + f.name)
        elif dataclasses.is_dataclass(default):
            out |= bool_keys(type(default), f"{prefix}{f.name}.")
    return out


def int_keys(cls: type = None, prefix: str = "") -> set:
    """The dotted names of the schema's integer settings (budget, seed, runtime.block_size, ...)."""
    out = set()
    for f in dataclasses.fields(cls or KvbenchConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.type in ("int", "Optional[int]", int, Optional[int]):
            out.add(prefix + f.name)
        elif dataclasses.is_dataclass(default):
            out |= int_keys(type(default), f"{prefix}{f.name}.")
    return out


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
    experiment: Optional[str] = None
    compression_ratio: Optional[float] = None

    def get(self, key: str, default: Any = None) -> Any:
        """Attribute access by name (for task code written against the raw config: cfg.get("seed"))."""
        return getattr(self, key, default)

    @property
    def method(self) -> Any:
        """The method as the raw config spelled it: .name and its options (for titles and labels)."""
        return SimpleNamespace(name=self.method_name, **self.method_options)


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
        raise UserError(f"unknown option {where}.{unknown[0]}: valid options are {', '.join(names)}"
                        f"{did_you_mean(unknown[0], names)}")
    return cls(**values)


def _check_root_keys(cfg: Any) -> None:
    try:
        keys = [str(k) for k in cfg.keys()]
    except Exception:  # pragma: no cover
        return
    for key in keys:
        if key not in ROOT_KEYS and key != "hydra":
            raise UserError(f"unknown option {key}: valid top-level options are {', '.join(ROOT_KEYS)}"
                            f"{did_you_mean(key, ROOT_KEYS)}")


def check_resolvable(cfg: Any) -> None:
    """UserError (one line) naming the first value whose interpolation (${...}) cannot be resolved."""
    if not OmegaConf.is_config(cfg):
        return
    try:
        for key in cfg.keys():
            if key != "hydra":  # Hydra's own node (present in composed test configs) resolves only in a job
                value = cfg[key]  # resolves a scalar (against the whole config)
                if OmegaConf.is_config(value):
                    OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = first_line(getattr(exc, "msg", None) or exc)
        raise UserError(f"cannot resolve {key}={raw_value(cfg, key)!r}: {msg}") from None


def validate(cfg: Any) -> Settings:
    """Check a composed run config and return it typed (storage resolved, budget null for a method that keeps
    every token, integral floats as ints); raises UserError naming the bad value. Needs no model."""
    check_resolvable(cfg)
    _check_root_keys(cfg)
    method = _section(cfg, "method")
    task = normalise_task(_section(cfg, "task"))
    check_task_counts(task)
    if not method.get("name"):
        raise UserError("method.name is missing: every method YAML needs `name:` (see conf/method/)")
    if not task.get("name"):
        raise UserError("task.name is missing: every task YAML needs `name:` (see conf/task/)")
    budget = check_budget(cfg.get("budget"))
    compression_ratio = check_compression(budget, cfg.get("compression_ratio"))
    seed = cfg.get("seed", 0)
    check_positive("seed", seed, minimum=0, maximum=SEED_MAX)
    model = _section(cfg, "model")
    quant = _section(cfg, "quant") or {"name": "none"}
    experiment = cfg.get("experiment")
    if experiment is not None and not isinstance(experiment, str):
        raise UserError(f"invalid experiment={experiment!r}: expected a name")
    method_name, method_options, quant_name, quant_options = resolve_storage(
        str(method.pop("name")), method, str(quant.pop("name", "none")), quant)
    budget, compression_ratio = kept_budget(method_name, budget, compression_ratio)
    check_retrieval_storage(method_name, quant_name)
    check_question_source(method_name, method_options, task)
    check_rewrite_storage(method_name, method_options, quant_name)
    check_threshold(method_options, budget, compression_ratio)
    results_dir = results_path(cfg.get("results_dir", "results"))
    return Settings(
        model=_build(ModelConfig, "model", model),
        runtime=_build(RuntimeConfig, "runtime", normalise_runtime(_section(cfg, "runtime"))),
        logger=_build(LoggerConfig, "logger", _section(cfg, "logger")),
        method_name=method_name,
        method_options=method_options,
        quant_name=quant_name,
        quant_options=quant_options,
        task_name=str(task.pop("name")),
        task_options=task,
        budget=budget,
        seed=int(seed),
        results_dir=results_dir,
        rerun=bool(cfg.get("rerun", False)),
        progress=bool(cfg.get("progress", True)),
        experiment=experiment,
        compression_ratio=compression_ratio,
    )


def _resolve_run_id(*, _root_: DictConfig) -> str:
    return run_id_for(hashable_config(_root_))


def _resolve_results_dir(*, _root_: DictConfig) -> str:
    """Hydra's sweep folder: results_dir as validate() reads it (`~` expanded, absolute). An unresolvable
    results_dir raises here, before Hydra makes a folder (run_cli prints it as one line)."""
    return results_path(_root_.results_dir)


def _resolve_run_dir(*, _root_: DictConfig) -> str:
    return os.path.join(results_path(_root_.results_dir), _resolve_run_id(_root_=_root_))


def schema_node() -> DictConfig:
    """KvbenchConfig as the config root Hydra composes over, its `method` section open: Hydra closes the root
    (struct mode) before it applies the overrides, and an open section keeps its own flag, so `method.decode=evict`
    sets an option the YAML does not list (a YAML holding only `name:` inherits every option of its dataclass).
    The known set of a method's options is its dataclass's fields, checked by methods.base.build_method before the
    model loads (one line naming the valid options)."""
    node = OmegaConf.structured(KvbenchConfig)
    node.method = OmegaConf.create({})
    node.method._set_flag("struct", False)  # type: ignore[union-attr]
    return node


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="kvbench_schema", node=schema_node())
    OmegaConf.register_new_resolver("kvbench_run_id", _resolve_run_id, replace=True)
    OmegaConf.register_new_resolver("kvbench_run_dir", _resolve_run_dir, replace=True)
    OmegaConf.register_new_resolver("kvbench_results_dir", _resolve_results_dir, replace=True)


register()
