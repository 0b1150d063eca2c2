"""kvbench as an lm-eval model: lm-eval tasks run on the paged runtime with a compression method applied.

Importing this module registers `KVBenchLM` as lm-eval model "kvbench" (lm-eval>=0.4.13,<0.5; with
kvbench.tasks._lm_eval_lm, which serves the requests, the only kvbench modules that import lm_eval). Three ways in:

    # lm-eval's own CLI (kvbench-lm-eval.pth registers the model and the packaged tasks: kvbench/commands/lm_eval_hook.py):
    lm_eval --model kvbench --model_args method=paged_eviction,budget=64 --tasks kvbench_essays_mc --device cpu
    # the same through this module, where the .pth is not installed:
    python -m kvbench.commands.lm_eval_adapter --model kvbench --model_args method=paged_eviction,budget=64 --tasks arc_easy
    # python, on an Engine you built (or through the registry with the same model_args):
    lm = KVBenchLM(engine=engine, tokenizer=tokenizer)
    lm_eval.simple_evaluate(model=lm, tasks=["my_task"], task_manager=TaskManager(include_path="my_tasks/"))
    # kvbench's own CLI: python -m kvbench task=lm_eval task.tasks=[arc_easy] method=... budget=...

model_args: pretrained (hub id or local folder; default the packaged SmolLM2-135M-Instruct), gguf_file, dtype,
device, method (a kvbench method name, default full), budget, the method's own options (any other key), block_size,
num_blocks, kv_memory_bytes, prefill_chunk_size, attention_backend, batch_size, max_length (default the model's max
positions), max_gen_toks (default 256), seed.

How requests meet the compressed cache:
- loglikelihood(context, continuation): the context but its last token is prefilled chunk by chunk, and the
  method compresses it as it would any prompt; its last token and the continuation (but the last token) then go in as
  one chunk, so every continuation token is predicted from the compressed cache (`Scorer.score_continuation`); the
  continuations of one context (multiple choice) share its prefill through forks (`Scorer.score_continuations`). A plain
  lm-eval model scores context + continuation in one forward pass, where compression could not matter.
  Too-long inputs keep their last max_length + 1 tokens, as lm-eval's HF model does.
- loglikelihood_rolling(text): lm-eval's rolling windows of max_length tokens, each streamed through
  `Scorer.score` (the method compresses after every chunk of prefill_chunk_size tokens).
- generate_until(context, gen_kwargs): the context (its last max_length - max_gen_toks tokens) is prefilled, then
  decoded greedily (or sampled if gen_kwargs ask for it) in batches of batch_size, stopping at EOS, the chat end
  tokens, or when the decoded text contains one of the `until` strings; the text is cut before the first of them.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Optional

import lm_eval.models  # noqa: F401  (the built-in models first: get_model imports them only into an empty registry)
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.registry import register_model

from kvbench.commands import lm_eval_hook
from kvbench.run.config import RuntimeConfig
from kvbench.run.engines import build_engine
from kvbench.errors import UserError
from kvbench.methods import build_method
from kvbench.runtime.model.loading import load_model
from kvbench.tasks._lm_eval_lm import EngineLM, int_option

log = logging.getLogger(__name__)


class KVBenchLM(EngineLM):
    """An lm-eval LM over a kvbench Engine (see the module docstring): the given engine and tokenizer, or both
    built from lm-eval's model_args (model, method, budget, runtime settings)."""

    def __init__(self, pretrained: Optional[str] = None, *, engine: Any = None, tokenizer: Any = None,
                 method: str = "full", budget: Any = None, gguf_file: Optional[str] = None, dtype: str = "float32",
                 device: Optional[str] = None, block_size: Any = 16, num_blocks: Any = None,
                 kv_memory_bytes: Any = None, prefill_chunk_size: Any = 512, attention_backend: str = "auto",
                 batch_size: Any = 1, max_batch_size: Any = None, max_length: Any = None, max_gen_toks: Any = 256,
                 seed: Any = None, progress: Any = None, **method_options: Any):
        if (engine is None) != (tokenizer is None):
            raise ValueError("pass both engine and tokenizer, or neither")
        if engine is None:
            engine, tokenizer = self._build(pretrained, method, budget, gguf_file, dtype, device, block_size,
                                            num_blocks, kv_memory_bytes, prefill_chunk_size, attention_backend,
                                            method_options)
        elif method_options or pretrained or budget is not None or method != "full":
            raise ValueError("with an existing engine, the model, method and budget are the engine's: pass none of "
                             "pretrained, method, budget or method options")
        super().__init__(engine, tokenizer, batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks,
                         seed=seed, progress=progress)

    # ------------------------------------------------------------------ construction from model_args
    @staticmethod
    def _build(pretrained, method, budget, gguf_file, dtype, device, block_size, num_blocks, kv_memory_bytes,
               prefill_chunk_size, attention_backend, method_options):
        device = str(device or "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            log.warning("kvbench: device %s requested (lm-eval's default is cuda:0) but CUDA is not available; "
                        "using cpu", device)
            device = "cpu"
        try:  # the runtime section a run would have (the serving knobs at their defaults)
            runtime = RuntimeConfig(block_size=int_option(block_size, "block_size") or 16,
                                    num_blocks=int_option(num_blocks, "num_blocks"),
                                    kv_memory_bytes=int_option(kv_memory_bytes, "kv_memory_bytes"),
                                    prefill_chunk_size=int_option(prefill_chunk_size, "prefill_chunk_size") or 512,
                                    attention_backend=str(attention_backend))
        except UserError as exc:
            raise ValueError(f"kvbench model_args: {exc}") from None
        loaded = load_model(pretrained or None, gguf_file=gguf_file or None, dtype=dtype, device=device)
        m = build_method(str(method), int_option(budget, "budget"), **method_options)
        return build_engine(runtime, loaded.model, m), loaded.tokenizer


def cli(argv: Optional[list[str]] = None) -> None:
    """lm-eval's command line (`lm_eval ...` arguments) with the kvbench model and its packaged tasks registered."""
    lm_eval_hook.install()  # where kvbench-lm-eval.pth is not installed: the packaged tasks without --include_path
    if argv is None:
        cli_evaluate()
        return
    saved = sys.argv
    sys.argv = ["lm_eval"] + list(argv)  # lm-eval's parser reads sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":  # `python -m kvbench.commands.lm_eval_adapter`: the model registered under its module's own name
    from kvbench.commands.lm_eval_adapter import cli as _cli

    _cli()
else:  # the name lm-eval's placeholder for it (kvbench/commands/lm_eval_hook.py) expects: kvbench.commands.lm_eval_adapter:KVBenchLM
    register_model("kvbench")(KVBenchLM)
