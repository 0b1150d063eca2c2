"""Config schemas (dataclasses) for `python -m kvbench`, registered in Hydra's ConfigStore.

The schemas are stored at the root of the ConfigStore under `kvbench_*` names, not inside the `model/`,
`task/`, ... groups, so they never show up as choices in `--help`. conf/config.yaml extends `kvbench_schema`.
Task options have no Hydra schema: each task validates its own (tasks.build_task), so this module imports no task.

Hydra checks types when it composes (budget=abc is refused there); `validate()` checks values (budget=-5, unknown
top-level keys added with `+`), resolves the storage codec (`method=kivi` = `method=full quant=kivi`) and turns a
DictConfig into these dataclasses, raising UserError with the bad value and what is allowed. `hashable_config()` is
the resolved form that names a run: two spellings of one setting give one run id.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from kvbench.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")
LOGGER_MODES = ("auto", "online", "offline", "disabled")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
SEED_MAX = 2**32 - 1  # numpy's limit (torch takes more; one range for every library)
BLOCK_SIZE_MAX = 4096  # tokens per KV block
# Storage codecs that are also accepted as a method name (`method=kivi` = `method=full quant=kivi`).
CODEC_METHODS = ("kivi", "kvquant", "int8", "fp8")
NON_EVICTING = ("full",) + CODEC_METHODS  # used only until methods declare `evicts`


def _check_positive(where: str, value: Any, *, allow_none: bool = False, minimum: int = 1,
                    maximum: Optional[int] = None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum \
            or (maximum is not None and value > maximum):
        allowed = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
        allowed += " or null" if allow_none else ""
        raise UserError(f"invalid {where}={value!r}: expected {allowed}")


def results_path(value: Any) -> str:
    """results_dir as an absolute path, `~` expanded: the one spelling used for run folders, Hydra's sweep folder
    and runs.jsonl alike."""
    return os.path.abspath(os.path.expanduser(str(value)))


EXACT_FLOAT_INT = 2**53  # integral floats up to this are exact integers


def normalise_numbers(values: Any, defaults: Optional[dict] = None) -> Any:
    """Integral floats as ints (`group_size=32.0` is `group_size=32`: one setting, one run id), in dicts and lists.
    With `defaults` (an option's declared default), an option whose default is a float keeps a float (`0` -> `0.0`).
    Floats beyond 2**53 are left as written (refused where an integer is expected)."""
    if isinstance(values, dict):
        out = {}
        for key, value in values.items():
            default = (defaults or {}).get(key)
            if isinstance(default, float) and not isinstance(value, bool) and isinstance(value, int):
                out[key] = float(value)
            elif isinstance(default, float):
                out[key] = value
            else:
                out[key] = normalise_numbers(value)
        return out
    if isinstance(values, list):
        return [normalise_numbers(v) for v in values]
    if isinstance(values, float) and values.is_integer() and abs(values) <= EXACT_FLOAT_INT:
        return int(values)
    return values


def did_you_mean(word: str, choices: Any) -> str:
    """ " (did you mean X?)" for the closest choice, or ""."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


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
        if self.path is not None and not str(self.path).strip():
            raise UserError("invalid model.path='': expected a hub id or a local folder")
        from kvbench.store.naming import model_label

        self.name = model_label(dataclasses.asdict(self)) if (self.path or self.name) else "unnamed"


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

    def __post_init__(self) -> None:
        if self.schedule not in ("mixed", "prefill_first"):
            raise UserError(f"invalid runtime.schedule={self.schedule!r}: choices are mixed, prefill_first")
        if self.prefix_caching not in ("auto", True, False):
            raise UserError(f"invalid runtime.prefix_caching={self.prefix_caching!r}: choices are auto, true, false")
        _check_positive("runtime.block_size", self.block_size, maximum=BLOCK_SIZE_MAX)
        _check_positive("runtime.num_blocks", self.num_blocks, allow_none=True, minimum=2)
        _check_positive("runtime.kv_memory_bytes", self.kv_memory_bytes, allow_none=True)
        _check_positive("runtime.prefill_chunk_size", self.prefill_chunk_size)
        _check_positive("runtime.batch_size", self.batch_size)
        _check_positive("runtime.threads", self.threads, allow_none=True, maximum=max(1024, os.cpu_count() or 1))
        _check_positive("runtime.max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("runtime.max_num_seqs", self.max_num_seqs)
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
        from types import SimpleNamespace

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


def method_evicts(name: str) -> bool:
    """Whether the method drops tokens (its `evicts` class attribute; methods without one: by name)."""
    try:
        from kvbench.methods import METHODS, available_methods

        available_methods()
        flag = getattr(METHODS.get(name), "evicts", None)
    except Exception:  # pragma: no cover - an unknown method is refused later
        flag = None
    return (name not in NON_EVICTING) if flag is None else bool(flag)


def resolve_storage(method_name: str, method_options: dict, quant_name: str,
                    quant_options: dict) -> tuple[str, dict, str, dict]:
    """`method=<codec>` -> `method=full quant=<codec>` (kvbench.quant.registry.resolve_storage where it exists),
    with integral floats as ints (a codec's float options kept floats: normalise_numbers)."""
    from kvbench.quant import registry

    fn = getattr(registry, "resolve_storage", None)
    if fn is not None:
        m_name, m_opts, q_name, q_opts = fn(method_name, dict(method_options), quant_name, dict(quant_options))
        return (m_name, normalise_numbers(m_opts), q_name,
                normalise_numbers(q_opts, getattr(registry, "OPTIONS", {}).get(q_name)))
    if method_name in CODEC_METHODS:  # fallback until the registry has resolve_storage
        if quant_name not in (None, "none", "full"):
            raise UserError(f"method={method_name} and quant={quant_name} both choose a storage codec: keep one "
                            f"(method=<eviction method> quant={quant_name}, or method={method_name} quant=none)")
        return "full", {}, method_name, dict(method_options)
    return method_name, dict(method_options), quant_name or "none", dict(quant_options)


def _check_root_keys(cfg: Any) -> None:
    try:
        keys = [str(k) for k in cfg.keys()]
    except Exception:  # pragma: no cover
        return
    for key in keys:
        if key not in ROOT_KEYS and key != "hydra":
            raise UserError(f"unknown option {key}: valid top-level options are {', '.join(ROOT_KEYS)}"
                            f"{did_you_mean(key, ROOT_KEYS)}")


def _raw_value(cfg: Any, full_key: str) -> Any:
    """The value at `full_key` (a.b[0].c) as written, interpolations unresolved; None when not found."""
    node: Any = OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg
    for part in full_key.replace("]", "").replace("[", ".").split("."):
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            return None
    return node


def check_resolvable(cfg: Any) -> None:
    """UserError (one line) naming the first value whose interpolation (${...}) cannot be resolved."""
    if not OmegaConf.is_config(cfg):
        return
    from omegaconf.errors import OmegaConfBaseException

    try:
        for key in cfg.keys():
            if key != "hydra":  # Hydra's own node (present in composed test configs) resolves only in a job
                value = cfg[key]  # resolves a scalar (against the whole config)
                if OmegaConf.is_config(value):
                    OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = (getattr(exc, "msg", None) or str(exc)).splitlines()[0]
        raise UserError(f"cannot resolve {key}={_raw_value(cfg, key)!r}: {msg}") from None


def check_compression(budget: Any, compression_ratio: Any) -> Optional[float]:
    """`compression_ratio`: the fraction of each prompt's KV removed at prefill (kvpress's meaning; 0.0 = keep
    all), a number in [0, 1), exclusive with `budget`; each eviction method turns it into a per-sequence budget
    (methods/eviction.py). Returns it as a float (or None); UserError on a bad value or both knobs set."""
    r = compression_ratio
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
        raise UserError(f"invalid compression_ratio={r!r}: expected a number in [0, 1) (the fraction of each "
                        "prompt's KV removed) or null")
    if budget is not None:
        raise UserError(f"budget={budget} and compression_ratio={r} are both set: choose one (budget = KV tokens "
                        "kept per sequence, layer and kv-head; compression_ratio = fraction of each prompt removed)")
    return float(r)


def validate(cfg: Any) -> Settings:
    """Check a composed run config and return it typed (storage resolved, budget null for a method that keeps
    every token, integral floats as ints); raises UserError naming the bad value. Needs no model."""
    check_resolvable(cfg)
    _check_root_keys(cfg)
    method = _section(cfg, "method")
    task = normalise_numbers(_section(cfg, "task"))
    if not method.get("name"):
        raise UserError("method.name is missing: every method YAML needs `name:` (see conf/method/)")
    if not task.get("name"):
        raise UserError("task.name is missing: every task YAML needs `name:` (see conf/task/)")
    budget = cfg.get("budget")
    _check_positive("budget", budget, allow_none=True)
    compression_ratio = check_compression(budget, cfg.get("compression_ratio"))
    seed = cfg.get("seed", 0)
    _check_positive("seed", seed, minimum=0, maximum=SEED_MAX)
    model = _section(cfg, "model")
    quant = _section(cfg, "quant") or {"name": "none"}
    experiment = cfg.get("experiment")
    if experiment is not None and not isinstance(experiment, str):
        raise UserError(f"invalid experiment={experiment!r}: expected a name")
    method_name, method_options, quant_name, quant_options = resolve_storage(
        str(method.pop("name")), method, str(quant.pop("name", "none")), quant)
    if not method_evicts(method_name):
        budget = compression_ratio = None  # nothing is evicted: every budget (or ratio) is the same run
    results_dir = results_path(cfg.get("results_dir", "results"))
    return Settings(
        model=_build(ModelConfig, "model", model),
        runtime=_build(RuntimeConfig, "runtime", _section(cfg, "runtime")),
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


def _raw_hashable(root: Any) -> dict:
    """The hashed sections, resolved (as written where an interpolation cannot be resolved: validate refuses it)."""
    from omegaconf.errors import OmegaConfBaseException

    out = {}
    for k in ("model", "method", "quant", "task", "runtime", "budget", "seed"):
        if k not in root:
            continue
        try:
            out[k] = OmegaConf.to_container(root[k], resolve=True) if OmegaConf.is_config(root[k]) else root[k]
        except OmegaConfBaseException:
            out[k] = _raw_value(root, k)
    if root.get("compression_ratio") is not None:  # absent when null: runs without it keep their ids
        out["compression_ratio"] = root["compression_ratio"]
    return out


def hashable_config(root: Any) -> dict:
    """The parts of a config that determine the result, in resolved form (storage codec moved to `quant`, budget
    null for a method that evicts nothing), so two spellings of one run hash alike. Never raises: a config that
    does not validate hashes as written (and is refused by validate)."""
    data = _raw_hashable(root)
    try:
        method = dict(data.get("method") or {})
        quant = dict(data.get("quant") or {"name": "none"})
        m_name, m_opts, q_name, q_opts = resolve_storage(str(method.pop("name", "")), method,
                                                         str(quant.pop("name", "none")), quant)
        data["method"] = {"name": m_name, **m_opts}
        data["quant"] = {"name": q_name, **q_opts}
        if isinstance(data.get("task"), dict):
            data["task"] = normalise_numbers(data["task"])
        if not method_evicts(m_name):
            if data.get("budget") is not None:
                data["budget"] = None
            data.pop("compression_ratio", None)
    except Exception:
        pass
    return data


def _resolve_run_id(*, _root_: DictConfig) -> str:
    from kvbench.store.naming import run_id_for

    return run_id_for(hashable_config(_root_))


def _resolve_results_dir(*, _root_: DictConfig) -> str:
    """Hydra's sweep folder: results_dir as validate() reads it (`~` expanded, absolute). An unresolvable
    results_dir raises here, before Hydra makes a folder (run_cli prints it as one line)."""
    return results_path(_root_.results_dir)


def _resolve_run_dir(*, _root_: DictConfig) -> str:
    return os.path.join(results_path(_root_.results_dir), _resolve_run_id(_root_=_root_))


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="kvbench_schema", node=KvbenchConfig)
    OmegaConf.register_new_resolver("kvbench_run_id", _resolve_run_id, replace=True)
    OmegaConf.register_new_resolver("kvbench_run_dir", _resolve_run_dir, replace=True)
    OmegaConf.register_new_resolver("kvbench_results_dir", _resolve_results_dir, replace=True)


register()
