"""Engines from a run's settings: the one place kvbench turns runtime settings into an Engine.

    codec = build_run_codec("kivi", {"bits": 2}, loaded)              # None: full precision
    engine = build_engine(settings.runtime, loaded.model, method, codec=codec)
    speculator = build_speculator(settings.runtime, loaded.model, draft_model, draft_method, draft_codec)

`runtime` is the run's runtime section (kvbench.run.config.RuntimeConfig: block size, pool size, prefill chunk,
attention backend, the serving knobs, speculative decoding, tensor parallelism). The app, the lm-eval adapter and
the benches that run from settings build their engines here; every knob goes to the engine by name (an engine class
given instead, a test's fake, takes the same keyword arguments). Bad values raise the engine's ValueError.
"""
from __future__ import annotations

from typing import Any

from kvbench.quant.registry import build_codec
from kvbench.runtime.serving.engine import Engine, kv_memory_bytes_for
from kvbench.runtime.serving.speculative import SpeculativeDecoder

# the serving knobs of the runtime section, passed to the engine under the same names
SERVING_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "admission_watermark", "schedule", "prefix_caching",
                 "cuda_graphs", "preemption", "swap_bytes")


def engine_options(runtime: Any) -> dict:
    """The Engine keyword arguments of a runtime section: the pool and chunk settings, the serving knobs, and the two
    rules a run adds: speculative decoding turns prefix caching off (the draft cache prefills every prompt itself;
    the plan refuses prefix_caching=true with it), tensor parallelism turns CUDA graphs off (a sharded decode step
    all-reduces between its layers: it runs eagerly)."""
    options = dict(block_size=runtime.block_size, num_blocks=runtime.num_blocks,
                   kv_memory_bytes=runtime.kv_memory_bytes, prefill_chunk_size=runtime.prefill_chunk_size,
                   attention_backend=runtime.attention_backend)
    options.update({k: getattr(runtime, k) for k in SERVING_KNOBS})
    if runtime.speculative.enabled:
        options["prefix_caching"] = False
    if runtime.tensor_parallel > 1:
        options["cuda_graphs"] = False
    return options


def build_engine(runtime: Any, model: Any, method: Any = None, *, codec: Any = None, speculator: Any = None,
                 engine_cls: type = Engine) -> Engine:
    """An engine over `model` with `method` (None: keep every token) and `codec` (None: full precision), set up by
    the runtime section; `speculator` (build_speculator) when runtime.speculative is on."""
    return engine_cls(model, method, codec=codec, speculator=speculator, **engine_options(runtime))


def build_run_codec(quant_name: str, quant_options: dict, model: Any, tokenizer: Any = None) -> Any:
    """The storage codec of the quant section for `model`, or None for full precision (none, full). KVQuant
    calibrates on the model's own forward over text it tokenizes with `tokenizer` unless its options name one."""
    if quant_name in ("none", "full"):
        return None
    options = dict(quant_options)
    if quant_name == "kvquant" and options.get("tokenizer") is None:
        options["tokenizer"] = tokenizer
    return build_codec(quant_name, model, **options)


def build_speculator(runtime: Any, target_model: Any, draft_model: Any, draft_method: Any, draft_codec: Any = None,
                     engine_cls: type = Engine) -> SpeculativeDecoder:
    """runtime.speculative's decoder: a draft engine (draft_model, the target's own or a smaller one, over a cache
    of draft_method and draft_codec, in a pool of the target's KV bytes; prefix caching off, the serving knobs at the
    engine's defaults: the speculator drives it step by step) proposing runtime.speculative.num_tokens per round."""
    spec = runtime.speculative
    target_bytes = kv_memory_bytes_for(target_model, runtime.block_size, runtime.num_blocks, runtime.kv_memory_bytes)
    draft = engine_cls(draft_model, draft_method, codec=draft_codec, block_size=runtime.block_size,
                       num_blocks=runtime.num_blocks, kv_memory_bytes=target_bytes,
                       prefill_chunk_size=runtime.prefill_chunk_size, attention_backend=runtime.attention_backend,
                       prefix_caching=False)
    return SpeculativeDecoder(draft, spec.num_tokens, adaptive=spec.adaptive)
