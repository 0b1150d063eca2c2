"""Step 1 of a run: validate every setting that needs no model, and build the method and the task.

    plan_run(cfg) -> RunPlan(settings, method, task, run_id, hashable, resolved, device, shape, setting_fields)

Checked here, before anything is loaded or written (UserError, one line, on bad input): config values
(kvbench.run.config.validate: interpolations resolvable, storage codec resolved, integral floats as ints, budget null
without eviction), the device, the model path (kvbench.run.model_info: a folder, .gguf file or a hub id that is cached
or on a reachable hub), the runtime against the model's shape (read from config.json or the GGUF header, never the
weights) and the device's memory, the codec's options (against the model's positions) and block geometry, the
method (method.seed in range; built, then its `preflight(settings, shape)` if it has one), the task (built, then
`task.preflight(settings, shape)`: data present, lengths within the model's positions, the KV pool large enough),
and that results_dir is writable.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from omegaconf import OmegaConf

from kvbench.run import config as _config
from kvbench.errors import UserError
from kvbench.methods import METHODS, build_method
from kvbench.methods.base import latent_refusal
from kvbench.run.model_info import check_runnable, kv_pool_bytes, model_shape
from kvbench.quant.registry import check_codec, storage_geometry
from kvbench.registry import did_you_mean as _did_you_mean
from kvbench.runtime.cache.kv_geometry import block_bytes, codec_block_size, min_pool_blocks
from kvbench.runtime.hooks import declared
from kvbench.runtime.model.distributed import env_world_size
from kvbench.runtime.model.loading import packaged_smollm2
from kvbench.runtime.model.model_files import check_model_path, gguf_location, read_gguf_header
from kvbench.run.spec import (FULL_PRECISION, SEED_MAX, check_positive, codec_names, hashable_config, normalise_runtime,
                          resolve_storage)
from kvbench.store.naming import run_id_for
from kvbench.reporting.summary import _bytes  # "1.5 GiB": the summary's byte format
from kvbench.tasks import build_task


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
    shape: Any  # kvbench.run.model_info.ModelShape or None
    setting_fields: dict = field(default_factory=dict)
    draft_method: Any = None  # runtime.speculative's draft method (None: speculative decoding off)
    draft_quant: tuple = ("none", {})  # (codec name, options) of the draft cache's storage


def _resolve_device(device: str) -> str:
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


def machine_memory_bytes(device: str) -> Optional[int]:
    """Total memory of the device the KV pool lives on (RAM for cpu, the GPU's for cuda), or None if unknown."""
    try:
        if device.startswith("cuda"):
            return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
        if device == "cpu":
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, RuntimeError, AttributeError):  # pragma: no cover
        return None
    return None


def _check_memory(rt: _config.RuntimeConfig, device: str, shape: Any, dtype: str) -> None:
    """A pool the user sized (num_blocks, kv_memory_bytes) must fit in the device's memory."""
    memory = machine_memory_bytes(device)
    if memory is None:
        return
    machine = f"this machine's {_bytes(memory)} of {device} memory"
    if rt.kv_memory_bytes is not None and rt.kv_memory_bytes > memory:
        raise UserError(f"invalid runtime.kv_memory_bytes={rt.kv_memory_bytes}: {_bytes(rt.kv_memory_bytes)} is "
                        f"more than {machine}; expected at most {memory}")
    if rt.kv_memory_bytes is None and rt.num_blocks is not None:
        pool = kv_pool_bytes(rt, shape, dtype)
        if pool is not None and pool > memory:
            block = pool // max(1, rt.num_blocks - 1)
            raise UserError(f"invalid runtime.num_blocks={rt.num_blocks}: {rt.num_blocks} blocks of {block} B are "
                            f"{_bytes(pool)}, more than {machine}; expected at most {memory // block + 1}")


def _check_codec_blocks(rt: _config.RuntimeConfig, shape: Any, dtype: str, quant_name: str,
                        quant_options: dict) -> None:
    """A codec whose groups need longer blocks (KIVI: a multiple of group_size) must still fit one block per
    layer and kv-head in the pool."""
    hint, fp_dtype = storage_geometry(quant_name, quant_options)
    tokens = codec_block_size(rt.block_size, hint)
    pool = kv_pool_bytes(rt, shape, dtype)
    if tokens == rt.block_size or pool is None:
        return
    fp_dtype = dtype if fp_dtype is None else fp_dtype
    block = block_bytes(tokens, shape.head_dim, fp_dtype)
    need = min_pool_blocks(shape.num_layers, shape.num_kv_heads, rt.batch_size)
    if pool // block < need:
        what = f"quant.group_size={hint}" if quant_name == "kivi" else f"quant={quant_name}"
        fit = pool // (need * block_bytes(1, shape.head_dim, fp_dtype))
        raise UserError(f"invalid {what}: it stores KV in blocks of {tokens} tokens ({_bytes(block)} each); "
                        f"this model needs at least {need} blocks ({_bytes(need * block)}) but the KV pool is "
                        f"{_bytes(pool)}: expected blocks of at most {fit} tokens, or a larger runtime.kv_memory_bytes")


def _check_swap_space(rt: _config.RuntimeConfig) -> None:
    """runtime.swap_bytes is host memory that preempted sequences' blocks move to: at most the host's RAM."""
    host = machine_memory_bytes("cpu")
    if rt.swap_bytes is not None and host is not None and rt.swap_bytes > host:
        raise UserError(f"invalid runtime.swap_bytes={rt.swap_bytes}: {_bytes(rt.swap_bytes)} of swap space is more "
                        f"than this host's {_bytes(host)} of memory; expected at most {host} (or null: as large as "
                        f"the KV pool)")


def _check_draft_budget(settings: _config.Settings, task: Any, shape: Any, draft_evicts: bool) -> None:
    """A draft budget at or above the longest context the task can make keeps every token, so the draft cache
    compresses nothing and speculation measures plain decoding with extra steps: refused."""
    spec = settings.runtime.speculative
    if not draft_evicts or spec.budget is None:
        return
    bounds = []  # (tokens, what sets them)
    longest = getattr(task, "longest_context", None)
    task_bound = longest() if callable(longest) else None
    if task_bound is not None:
        bounds.append((task_bound[0], f"task={settings.task_name} makes contexts of at most {task_bound[0]:,} "
                                      f"tokens ({task_bound[1]})"))
    positions = getattr(shape, "max_positions", None)
    if positions:
        bounds.append((positions, f"the model holds at most {positions:,} positions"))
    if not bounds:
        return
    tokens, why = min(bounds)
    if spec.budget >= tokens:
        raise UserError(f"invalid runtime.speculative.budget={spec.budget}: {why}, so the draft cache would keep "
                        f"every token and compress nothing; expected a budget below {tokens}")


def _check_runtime(rt: _config.RuntimeConfig, device: str, shape: Any, dtype: str) -> None:
    backend = rt.attention_backend
    if backend == "triton" and not device.startswith("cuda"):
        raise UserError(f"invalid runtime.attention_backend=triton on model.device={device}: "
                        f"triton needs cuda; choices here: auto, torch, cpu")
    if backend == "cpu" and device != "cpu":
        raise UserError(f"invalid runtime.attention_backend=cpu on model.device={device}: choices: auto, torch, triton")
    _check_memory(rt, device, shape, dtype)
    _check_swap_space(rt)
    if shape is None:
        return
    need = min_pool_blocks(shape.num_layers, shape.num_kv_heads, rt.batch_size)  # a block per table, the scratch
    if rt.num_blocks is not None and rt.num_blocks < need:
        raise UserError(f"invalid runtime.num_blocks={rt.num_blocks}: this model needs at least {need} "
                        f"({shape.num_layers} layers x {shape.num_kv_heads} kv-heads x batch {rt.batch_size} + 1)")
    if rt.num_blocks is None and rt.kv_memory_bytes is not None:
        block = block_bytes(rt.block_size, shape.head_dim, dtype)
        if rt.kv_memory_bytes // block < need:
            raise UserError(f"invalid runtime.kv_memory_bytes={rt.kv_memory_bytes}: holds "
                            f"{rt.kv_memory_bytes // block} blocks of {block} B; this model needs at "
                            f"least {need} ({need * block} bytes)")


def _token_list(path: Optional[str], gguf_file: Optional[str]) -> Optional[list]:
    """The tokenizer's tokens in id order, read from the files (a GGUF's header, a folder's tokenizer.json) without
    loading the model; None where that cannot be read here (a hub id not on disk)."""
    if path is None:
        path, gguf_file = packaged_smollm2()
    local = os.path.expanduser(str(path))
    try:
        gguf = gguf_location(path, gguf_file)  # a .gguf, a folder holding one, a packaged model
        if gguf is not None:
            return read_gguf_header(gguf, "model", string_arrays=True).get("tokenizer.ggml.tokens")
        with open(os.path.join(local, "tokenizer.json")) as fh:
            tj = json.load(fh)
    except (OSError, KeyError, ValueError, UserError):
        return None
    vocab = dict(tj.get("model", {}).get("vocab") or {})
    if not isinstance(vocab, dict):  # a unigram vocab: [[token, score], ...]
        vocab = {tok: i for i, (tok, _) in enumerate(vocab)}
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]


LATENT_CODECS = ("kivi", "int8", "fp8")  # the codecs that store MLA's latent rows


def _check_latent(settings: _config.Settings, shape: Any, method: Any) -> None:
    """An MLA model (its cache the latent rows): methods whose scores are defined there, the codecs that pack the
    rows (kivi, int8, fp8: runtime.cache.caches.latent_codec)."""
    if shape is None or not getattr(shape, "latent", False):
        return
    if settings.quant_name not in FULL_PRECISION + LATENT_CODECS:
        raise UserError(f"quant={settings.quant_name!r} cannot run on an MLA model ({shape.model_type}): its levels "
                        f"and ranges are calibrated per layer on keys before RoPE; use quant=none, "
                        f"{', '.join(LATENT_CODECS)}")
    why = latent_refusal(method)
    if why is not None:
        raise UserError(why)


def _check_parallel(settings: _config.Settings, shape: Any, method: Any) -> None:
    """runtime.tensor_parallel against the launch (torchrun's WORLD_SIZE), the model's kv-heads and what the method
    and codec can do on a kv-head shard (kvbench/runtime/model/tensor_parallel.py); before anything loads."""
    tp, world = settings.runtime.tensor_parallel, env_world_size()
    if tp == 1:
        return
    where = f"invalid runtime.tensor_parallel={tp}"
    if tp > world:
        raise UserError(f"{where}: larger than the {world} process(es) of this launch; start it with "
                        f"`torchrun --nproc-per-node {tp} -m kvbench ...` (or a multiple of {tp} processes)")
    if world % tp:
        raise UserError(f"{where}: does not divide the {world} processes of this launch (data-parallel groups "
                        f"are world / tensor_parallel ranks each)")
    if shape is not None and shape.num_kv_heads % tp:
        fits = [d for d in range(1, shape.num_kv_heads + 1) if shape.num_kv_heads % d == 0]
        raise UserError(f"{where}: the model's {shape.num_kv_heads} kv-heads are not divisible by {tp} (each rank "
                        f"holds whole kv-heads); choices: {', '.join(map(str, fits))}")
    if shape is not None and not shape.plain:
        what = "an MLA latent cache" if shape.latent else f"{shape.sliding_layers} sliding-window layers"
        raise UserError(f"{where}: the model ({shape.model_type}, {what}) is not sharded: tensor parallelism runs "
                        f"Llama-family models (llama, mistral, qwen2, qwen3) with full attention only")
    why = declared(method).tensor_parallel_refusal()
    if why:
        raise UserError(f"method {settings.method_name!r} cannot run with runtime.tensor_parallel={tp}: {why}")
    if settings.quant_name == "kvquant":
        raise UserError(f"quant 'kvquant' cannot run with runtime.tensor_parallel={tp}: its calibration fits "
                        f"levels over every kv-head of the whole model")
    if settings.runtime.speculative.enabled:
        raise UserError(f"runtime.speculative cannot run with runtime.tensor_parallel={tp}: the draft engine is "
                        f"not sharded; set runtime.speculative.num_tokens=0")
    if settings.runtime.preemption != "recompute":
        raise UserError(f"runtime.preemption={settings.runtime.preemption} cannot run with runtime.tensor_parallel="
                        f"{tp}: whether to swap is timed on each rank, and the ranks must preempt alike; "
                        f"use runtime.preemption=recompute")


def _check_speculative(settings: _config.Settings, task: Any, build_method_fn: Callable,
                       shape: Any) -> tuple[Any, tuple]:
    """runtime.speculative (on when num_tokens >= 1): the target's method must keep what it verifies (none that acts
    inside the attention steps), the task must decode through the scheduler, no prefix caching, the draft method a
    known method or codec, a draft model with the target's tokenizer. Returns (draft method, (codec, options))."""
    spec = settings.runtime.speculative
    if not spec.enabled:
        return None, ("none", {})
    k = f"runtime.speculative.num_tokens={spec.num_tokens}"
    if shape is not None and getattr(shape, "sliding_layers", 0):
        raise UserError(f"{k} cannot run with a model with sliding-window layers: a rollback needs tokens the "
                        f"layers' rings have already freed; set runtime.speculative.num_tokens=0")
    if METHODS.get(settings.method_name).acts_after_attention:
        raise UserError(f"{k} cannot run with method={settings.method_name}: it evicts inside the steps that "
                        "verification batches, so the target would not be the model that plain decoding runs; use "
                        f"method=full (or quant=<codec>) and runtime.speculative.method={settings.method_name}")
    if not getattr(task, "decodes", False):
        raise UserError(f"{k} cannot run with task={settings.task_name}: it does not generate tokens through the "
                        "engine's scheduler; tasks that do: throughput, longbench, longbench_e, govreport, needle, ruler, "
                        "summarization")
    if settings.runtime.prefix_caching is True:
        raise UserError(f"{k} cannot run with runtime.prefix_caching=true: the draft cache prefills every prompt "
                        "itself; use runtime.prefix_caching=auto or false")
    choices = sorted(set(METHODS.names()) | (set(codec_names()) - {"none"}))
    if spec.method not in choices:
        raise UserError(f"unknown runtime.speculative.method {spec.method!r}{_did_you_mean(spec.method, choices)}; "
                        f"choices are {', '.join(choices)}")
    name, options, quant, quant_options = resolve_storage(spec.method, {}, "none", {})
    try:
        draft = build_method_fn(name, spec.budget if METHODS.get(name).evicts else None)
        declared(draft).preflight(settings, shape)  # e.g. a budget too small for runtime.block_size
    except UserError as exc:
        raise UserError(f"invalid runtime.speculative.method={spec.method} with runtime.speculative.budget="
                        f"{spec.budget}: {exc}") from None
    _check_draft_budget(settings, task, shape, METHODS.get(name).evicts)
    if spec.draft != "self":
        label = f"runtime.speculative.draft={spec.draft!r}"
        try:
            check_model_path(spec.draft, None, check_hub=True)
        except UserError as exc:
            raise UserError(str(exc).replace(f"model.path={str(spec.draft)!r}", label)) from None
        mine, theirs = _token_list(settings.model.path, settings.model.gguf_file), _token_list(spec.draft, None)
        if mine is not None and theirs is not None and mine != theirs:
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise UserError(f"invalid {label}: its tokenizer differs from the target model's ({len(theirs)} tokens "
                            f"against {len(mine)}, first difference at id {first}); a draft model must share the "
                            "target's tokenizer")
    return draft, (quant, quant_options)


def _build_method(build_method_fn: Callable, settings: _config.Settings) -> Any:
    """The method, given the top-level seed (a method's own `method.seed`, when set, wins)."""
    options = dict(settings.method_options)
    check_positive("method.seed", options.get("seed"), allow_none=True, minimum=0, maximum=SEED_MAX)
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


def _check_prefix_caching(settings: _config.Settings, method: Any, shape: Any = None) -> None:
    """runtime.prefix_caching=true with a method that accumulates attention over every prompt query (H2O, and
    methods built over it): a shared prefix would skip those queries; or with one that prunes key channels (ThinK):
    the channels follow the whole prompt's window, which a shared prefix would take from another prompt. The engine
    refuses both too (its own API)."""
    if settings.runtime.prefix_caching is not True:
        return
    method = declared(method)
    if method.needs_key_scores:
        raise UserError(f"invalid runtime.prefix_caching=true with method={settings.method_name}: it accumulates "
                        "attention over every prompt query, which a shared prefix skips; choices are auto, false")
    if method.pruned_key_channels(shape.head_dim if shape is not None else 1 << 16) > 0:
        raise UserError(f"invalid runtime.prefix_caching=true with method={settings.method_name}: it prunes key "
                        "channels chosen by each whole prompt, which a shared prefix would take from another "
                        "prompt; choices are auto, false")


def _check_results_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kvbench-probe-", dir=path)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise UserError(f"results_dir={path!r} is not writable: {exc.strerror or exc}") from None


def _positions_as_run(shape: Any, method: Any) -> Any:
    """The model's shape as the task's checks see it: a method that re-indexes positions inside the cache
    (StreamingLLM's position_mode=reindex: rope_mode) never runs past the model's positions, however long the text,
    so no position limit (the engine's rule, Engine.check_positions)."""
    if shape is None or method is None or declared(method).rope_mode == "original":
        return shape
    return dataclasses.replace(shape, max_positions=None)


def plan_run(cfg: Any, *, build_method_fn: Optional[Callable] = None) -> RunPlan:
    """Step 1: validate every setting that needs no model and build method and task; UserError on bad input."""
    settings = _config.validate(cfg)
    device = _resolve_device(settings.model.device)
    if settings.model.path is not None:  # None: the packaged model
        check_model_path(settings.model.path, settings.model.gguf_file, check_hub=True)
        check_runnable(settings.model)  # config.json (model type, sizes, window) and the tensors against it
    shape = model_shape(settings.model)
    _check_runtime(settings.runtime, device, shape, settings.model.dtype)
    # the codec's options (its name was resolved by validate), without the model: kvquant's calibration needs it,
    # so only its settings and its calibration length against the model's positions
    check_codec(settings.quant_name, dict(settings.quant_options), shape)
    if shape is not None:
        _check_codec_blocks(settings.runtime, shape, settings.model.dtype, settings.quant_name,
                            settings.quant_options)
    if build_method_fn is None:
        build_method_fn = build_method
    method = _build_method(build_method_fn, settings)
    _check_prefix_caching(settings, method, shape)
    _check_parallel(settings, shape, method)
    _check_latent(settings, shape, method)
    declared(method).preflight(settings, shape)  # e.g. a budget too small for runtime.block_size
    task = build_task(settings.task_name, {"name": settings.task_name, **settings.task_options})
    preflight = getattr(task, "preflight", None)
    if callable(preflight):
        preflight(settings, _positions_as_run(shape, method))
    draft_method, draft_quant = _check_speculative(settings, task, build_method_fn, shape)
    _check_results_dir(settings.results_dir)
    hashable = hashable_config(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    # what runs, in resolved form: method=kivi is recorded as method=full quant=kivi; no budget without eviction
    resolved.update(task={"name": settings.task_name, **settings.task_options},
                    runtime=normalise_runtime(resolved.get("runtime") or {}),
                    method={"name": settings.method_name, **settings.method_options},
                    quant={"name": settings.quant_name, **settings.quant_options}, budget=settings.budget,
                    compression_ratio=settings.compression_ratio)
    fields = {"model_path": settings.model.path, "model_gguf_file": settings.model.gguf_file,
              **flat("task_", settings.task_options),
              **flat("runtime_", {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                                  for k, v in vars(settings.runtime).items() if k not in ("threads", "cuda_graphs")}),
              "quant": settings.quant_name, **flat("quant_", settings.quant_options),
              "data_sha256": hashable.get("data_sha256"),  # the data files' content (kvbench.run.data_digest)
              "method_files_sha256": hashable.get("method_files_sha256"),  # the files the method's options name
              "model_sha256": hashable.get("model_sha256"),  # the model's config, tokenizer and weights
              "method_source_sha256": hashable.get("method_source_sha256")}  # the method's own source files
    for key in ("data_sha256", "method_files_sha256", "model_sha256", "method_source_sha256"):
        if hashable.get(key) is not None:
            resolved[key] = hashable[key]
    return RunPlan(settings, method, task, run_id_for(hashable), hashable, resolved, device, shape, fields,
                   draft_method, draft_quant)
