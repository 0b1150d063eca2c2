"""Shared pieces of the generation tasks: prompts and stop tokens, a batched greedy loop, timing figures.

    requests = [GenRequest(id=..., dataset=..., prompt=text, token_ids=ids, max_new_tokens=64, references=[...])]
    outputs, perf = run_generation(engine, tokenizer, requests, batch_size=cfg.runtime.batch_size)

Requests are cut into batches of `batch_size` consecutive requests with the same max_new_tokens and stop tokens;
each batch goes through `engine.generate` (the scheduler: prompts admitted as the pool allows, decoded together,
greedy; a prompt that cannot fit in the pool is a UserError naming the sizes). A
prediction is the generated tokens decoded with special tokens skipped (so the stop token is not in it).

Query-agnostic compression (`task.compress_question=false`, kvpress's default): a request's last
`uncompressed_tail` prompt tokens are its question; the scheduler prefills the context chunk by chunk (the method
compresses it at its last chunk), then the question uncompressed (never evicted in its own steps, added to the
sequence's budget), then decodes as for any request (kvbench.runtime.serving.requests.Request.uncompressed_tail).
`split_prompt` tokenizes a prompt as context + question for it.

perf (also written per sample as ttft_s / prefill_s / decode_s):
- ttft_s                mean over samples of the time from the start of a prompt's prefill to its first token
- prefill_tokens_per_s  all prompt tokens / all prefill time
- decode_tokens_per_s   all tokens generated after the first / wall time of the batched decode loops (with
                        batch_size > 1 the decode steps of a batch are shared, so this is throughput)
- peak_kv_bytes         the engine pool's peak so far (app.py records the final value from engine.memory_stats())

"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from kvbench.errors import UserError
from kvbench.metrics.repetition import repetition_share
from kvbench.runtime.hooks import declared
from kvbench.runtime.model import distributed
from kvbench.run.spec import check_positive

# End-of-turn / end-of-text tokens of the common chat formats; those the tokenizer knows stop generation.
CHAT_END_TOKENS: tuple[str, ...] = (
    "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "</s>",
)  # fmt: skip
CHAT_TEMPLATE_CHOICES = ("auto", "true", "false")


# --------------------------------------------------------------------------- prompts and tokens
def check_chat_template_option(value: Any, where: str = "task.chat_template") -> str:
    """Normalise a chat_template option (auto | true | false, YAML booleans allowed) to one of CHAT_TEMPLATE_CHOICES."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).lower()
    if text not in CHAT_TEMPLATE_CHOICES:
        raise UserError(f"invalid {where}={value!r}: choices are auto, true, false")
    return text


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def wants_chat_template(option: str, tokenizer: Any) -> bool:
    """Whether to template prompts: 'auto' = when the tokenizer has a chat template."""
    option = check_chat_template_option(option)
    if option == "true":
        if not has_chat_template(tokenizer):
            raise UserError("task.chat_template=true but the tokenizer has no chat template")
        return True
    return option == "auto" and has_chat_template(tokenizer)


def apply_chat(tokenizer: Any, user: str, system: Optional[str] = None) -> str:
    """The text of one user turn (after an optional system turn) in the model's chat format, ready for the answer."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def encode(tokenizer: Any, text: str, templated: bool) -> list[int]:
    """Token ids of a prompt. Chat-templated text already holds its special tokens (no BOS added again);
    raw text gets the tokenizer's default special tokens, as LongBench's pred.py tokenizes it."""
    if templated:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def stop_token_ids(tokenizer: Any, extra: Iterable[int] = (), generation_config: Any = None) -> tuple[int, ...]:
    """EOS of the tokenizer (and of a generation config, if given) plus the chat end tokens it knows."""
    ids: set[int] = set(int(t) for t in extra)
    eos = getattr(tokenizer, "eos_token_id", None)
    for source in (eos, getattr(generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(t) for t in source)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials.update(getattr(tokenizer, "added_tokens_encoder", {}) or {})
    for tok in CHAT_END_TOKENS:
        if tok in vocab and tok in specials:
            ids.add(int(vocab[tok]))
    return tuple(sorted(ids))


def model_context_length(engine: Any, default: int = 4096) -> int:
    """The model's max positions (engine.model.config.max_position_embeddings), or default if unknown."""
    cfg = getattr(getattr(engine, "model", None), "config", None)
    n = getattr(cfg, "max_position_embeddings", None)
    return int(n) if n else default


def check_bool_option(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"invalid {where}={value!r}: expected true or false")


def batch_size_of(cfg: Any) -> int:
    """cfg.runtime.batch_size (1 when the config has none)."""
    try:
        rt = cfg.get("runtime") if hasattr(cfg, "get") else getattr(cfg, "runtime", None)
        value = (rt.get("batch_size") if hasattr(rt, "get") else getattr(rt, "batch_size", None)) if rt else None
    except Exception:
        value = None
    return int(value) if value else 1


# --------------------------------------------------------------------------- the batched loop
@dataclass
class GenRequest:
    id: str
    dataset: Optional[str]
    prompt: str  # the exact text given to the tokenizer (after templating and truncation)
    token_ids: list[int]
    max_new_tokens: int
    references: list = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)  # copied into the sample record
    uncompressed_tail: int = 0  # the last tokens of token_ids (the question) are appended after compression
    question_tokens: int = 0  # query-aware: the last tokens of token_ids are the question, compressed with it


@dataclass
class GenOutput:
    request: GenRequest
    prediction: str
    token_ids: list[int]
    finish_reason: str
    ttft_s: float
    prefill_s: float
    decode_s: float
    kv_kept_fraction: Optional[float] = None  # the prompt's KV kept after compression (None: nothing compressed)

    def record(self, **metrics: Any) -> dict:
        """The sample record: id, dataset, prompt, prediction, references, lengths, the generated tokens'
        repetition share (metrics/repetition.py: near 1.0 = degenerate, "ThisThisThis..."), timings, then metrics."""
        r = self.request
        out = {
            "id": r.id, "dataset": r.dataset, "prompt": r.prompt, "prediction": self.prediction,
            "references": list(r.references), "prompt_tokens": len(r.token_ids), "new_tokens": len(self.token_ids),
            "repetition": round(repetition_share(self.token_ids), 4),
            "finish_reason": self.finish_reason, "ttft_s": self.ttft_s, "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
        }
        if self.kv_kept_fraction is not None:  # realized per sample (threshold rules keep what the input decides)
            out["kv_kept_fraction"] = self.kv_kept_fraction
        out.update(r.extra)
        out.update(metrics)
        return out


class PerfMeter:
    """Accumulates the timing of generation batches (see the module docstring for the figures)."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.ttfts: list[float] = []

    def add_batch(self, gens: Sequence[Any]) -> None:
        for g in gens:
            self.prefill_tokens += g.prefill_tokens
            self.prefill_s += g.prefill_s
            self.decode_tokens += g.decode_tokens
            self.ttfts.append(g.ttft_s)
        # decode steps are shared by the batch: its wall time is the longest sequence's decode time
        self.decode_s += max((g.decode_s for g in gens), default=0.0)

    def add_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_s += seconds

    def perf(self, engine: Any = None) -> dict:
        out = {
            "ttft_s": sum(self.ttfts) / len(self.ttfts) if self.ttfts else None,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None,
            "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s > 0 else None,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
        }
        if engine is not None and hasattr(engine, "memory_stats"):
            try:
                out["peak_kv_bytes"] = engine.memory_stats().get("peak_kv_bytes")
            except Exception:  # pragma: no cover
                pass
        return out


def _batches(requests: Sequence[GenRequest], batch_size: int) -> list[list[GenRequest]]:
    """Consecutive runs of requests with the same generation settings, cut to batch_size."""
    out: list[list[GenRequest]] = []

    def key(r: GenRequest) -> tuple:
        return r.max_new_tokens, tuple(sorted(r.stop_ids)), r.uncompressed_tail > 0

    for r in requests:
        last = out[-1] if out else None
        if last and len(last) < batch_size and key(last[0]) == key(r):
            last.append(r)
        else:
            out.append([r])
    return out


def split_prompt(tokenizer: Any, prompt: str, question_start: int, templated: bool) -> tuple[list[int], int]:
    """Token ids of prompt[:question_start] (the context, with the tokenizer's special tokens unless templated)
    followed by those of prompt[question_start:] (the question and what follows it, no special tokens), and the
    number of the latter: the two parts are tokenized apart, as kvpress's pipeline does."""
    head = encode(tokenizer, prompt[:question_start], templated)
    tail = list(tokenizer(prompt[question_start:], add_special_tokens=False)["input_ids"])
    return head + tail, len(tail)


def split_question(tokenizer: Any, prompt: str, question_start: int, question_end: int,
                   templated: bool) -> tuple[list[int], int, int]:
    """kvpress's query-aware loop (evaluate.py `query_aware`, pipeline.preprocess): the token ids of the context
    prompt[:question_start], the question prompt[question_start:question_end] and what follows it (the turn's end,
    the answer prefix), the three tokenized apart as kvpress's Finch delimiter and its pipeline's question suffix
    split them; with the question's token count (the window: Request.question_tokens) and that of what follows
    (appended after compression: Request.uncompressed_tail)."""
    ids, question = split_prompt(tokenizer, prompt[:question_end], question_start, templated)
    after = list(tokenizer(prompt[question_end:], add_special_tokens=False)["input_ids"]) \
        if question_end < len(prompt) else []
    return ids + after, question, len(after)


def template_and_split(tokenizer: Any, prompt: str, question: str, templated: bool,
                       compress_question: bool) -> tuple[str, list[int], int]:
    """The prompt in the chat template (when templated) and its token ids; with compress_question=False and the
    question found in it, the ids are split_prompt's (the part from the question on appended uncompressed) and the
    last value is that part's token count, else 0 (the whole prompt compressed)."""
    split = prompt.rfind(question) if question and not compress_question else -1
    if templated:
        prompt = apply_chat(tokenizer, prompt)
        split = prompt.rfind(question) if split >= 0 else -1
    if split >= 0:
        ids, tail = split_prompt(tokenizer, prompt, split, templated)
        return prompt, ids, tail
    return prompt, encode(tokenizer, prompt, templated), 0


def question_count(tokenizer: Any, prompt: str, question: str, templated: bool) -> int:
    """Tokens of the prompt's part from its question on (tokenized apart, as kvpress's Finch delimiter splits the
    prompt), for a query-aware request's question_tokens; 0 when the question is not found."""
    split = prompt.rfind(question) if question else -1
    return split_prompt(tokenizer, prompt, split, templated)[1] if split >= 0 else 0


def kept_stats(engine: Any) -> dict:
    """The method's prefill_stats (tokens kept per layer and kv-head after each prompt's compression), or {}; in a
    data-parallel launch, over the prompts of every rank."""
    method = declared(getattr(engine, "method", None))  # a fake engine may hold none
    totals = method.prefill_totals()
    if totals is not None and distributed.current() is not None:
        return dict(method.prefill_stats(distributed.sum_over_data_parallel(totals)))
    return dict(method.prefill_stats())


def run_generation(engine: Any, tokenizer: Any, requests: Sequence[GenRequest], *, batch_size: int = 1,
                   progress: Any = None, desc: str = "generate",
                   on_batch: Optional[Callable[[list[GenOutput]], None]] = None) -> tuple[list[GenOutput], dict]:
    """Greedy generation for every request (in order), batched; returns the outputs and the perf figures. In a
    data-parallel launch (kvbench.runtime.model.distributed) this rank generates its share of the requests, and the
    outputs of every rank come back in request order; perf is this rank's (`samples_computed` of them)."""
    check_positive("runtime.batch_size", batch_size)
    meter = PerfMeter()
    outputs: list[GenOutput] = []
    mine = distributed.shard(requests)  # [(index, request)] of this rank
    bar = progress(total=len(mine), desc=desc, unit="sample") if progress is not None else None
    try:
        for batch in _batches([r for _, r in mine], batch_size):
            # a speculative engine's target keeps every token (full or a codec), so the question needs no split
            split = batch[0].uncompressed_tail > 0 and getattr(engine, "speculator", None) is None
            gens = engine.generate([r.token_ids for r in batch], max_new_tokens=batch[0].max_new_tokens,
                                   stop_token_ids=batch[0].stop_ids, temperature=0.0,
                                   uncompressed_tails=[r.uncompressed_tail for r in batch] if split else None,
                                   question_tokens=[r.question_tokens for r in batch])
            failed = [g for g in gens if g.finish_reason == "failed"]
            if failed:  # an accuracy task needs every sample: a pool too small for its prompts is a setting
                raise UserError(f"{failed[0].error} (task sample {batch[gens.index(failed[0])].id})")
            meter.add_batch(gens)
            done = [GenOutput(r, decode(tokenizer, g.token_ids), list(g.token_ids), g.finish_reason, g.ttft_s,
                              g.prefill_s, g.decode_s, getattr(g, "kv_kept_fraction", None))
                    for r, g in zip(batch, gens)]
            outputs.extend(done)
            if on_batch is not None:
                on_batch(done)
            if bar is not None:
                bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
    perf = meter.perf(engine)
    if distributed.current() is not None:
        perf["samples_computed"] = len(outputs)
        outputs = distributed.gather_in_order([(i, o) for (i, _), o in zip(mine, outputs)])
    return outputs, perf


def mean_x100(values: Iterable[float], ndigits: int = 2) -> Optional[float]:
    """100 x mean, rounded (the LongBench reporting); None for no values, NaN-free."""
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return round(100 * sum(vals) / len(vals), ndigits) if vals else None


