"""`task=longbench_v2`: LongBench v2 (THUDM/LongBench-v2), 503 four-choice questions, as its pred.py runs them.

Per item (kvbench.data.longbench_v2): the official 0-shot prompt; if longer than `max_length` tokens, cut in the
middle (the first and last max_length/2 tokens, decoded and joined); the chat template (`chat_template`: auto = when
the tokenizer has one); at most `max_new_tokens` (128, pred.py) new tokens, stopping at EOS, greedy (pred.py asks
its API server for temperature 0.1; greedy keeps runs repeatable). The answer is pred.py's extract_answer
("The correct answer is (X)", else "The correct answer is X", after removing '*').

`compress_question` as for RULER: false (default, query-agnostic: kvpress's protocol) compresses the document, then
appends the question, the choices and the format line uncompressed; true compresses the whole prompt (query-aware
only in that the question is in the compressed prompt).

Metrics: `accuracy` (100 x mean), and by difficulty (`accuracy_easy`, `accuracy_hard`) and by length
(`accuracy_short`, `accuracy_medium`, `accuracy_long`), as the official result table; null where no item.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvbench.data import longbench_v2 as lv2
from kvbench.data.hub import check_revision, require_hub
from kvbench.data.longbench import truncate_prompt_middle
from kvbench.errors import UserError
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (GenRequest, batch_size_of, check_bool_option, check_chat_template_option,
                                       kept_stats, model_context_length, run_generation, stop_token_ids,
                                       template_and_split, wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, register_task


@dataclass
class LongBenchV2Options:
    name: str = "longbench_v2"
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    data_path: Optional[str] = None  # data.json (the hub's file), a jsonl / parquet copy or a folder; null = hub
    limit: Optional[int] = None
    max_length: Optional[int] = None  # prompt tokens kept (null: the model's positions minus max_new_tokens + 64)
    max_new_tokens: int = 128
    chat_template: Any = "auto"
    compress_question: bool = False

    def __post_init__(self) -> None:
        check_revision(self.revision, "data_path", self.data_path)
        check_positive("task.limit", self.limit, allow_none=True)
        check_positive("task.max_length", self.max_length, allow_none=True, minimum=2)
        check_positive("task.max_new_tokens", self.max_new_tokens)
        self.chat_template = check_chat_template_option(self.chat_template)
        check_bool_option("task.compress_question", self.compress_question)


def question_part(record: dict) -> str:
    """What the prompt puts after the document: the question, the choices and the format line."""
    return lv2.build_prompt(dict(record, context="")).split(lv2.QUESTION_MARK, 1)[1]


@register_task("longbench_v2")
class LongBenchV2(Task):
    Options = LongBenchV2Options

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        limit = getattr(model_shape, "max_positions", None)
        if limit and self.options.max_new_tokens >= limit:
            raise UserError(f"invalid task.max_new_tokens={self.options.max_new_tokens}: the model has {limit} "
                            f"positions")
        if self.options.data_path is not None:
            lv2.check_local(self.options.data_path)
        else:
            require_hub("LongBench v2 data", "task.data_path")

    def build_request(self, tokenizer: Any, record: dict, max_length: int, chat: bool, stops: tuple) -> GenRequest:
        opts = self.options
        full = lv2.build_prompt(record)
        prompt = truncate_prompt_middle(tokenizer, full, max_length)
        truncated = prompt != full
        prompt, ids, tail = template_and_split(tokenizer, prompt, question_part(record), chat, opts.compress_question)
        return GenRequest(id=str(record["_id"]), dataset="longbench_v2", prompt=prompt, token_ids=ids,
                          max_new_tokens=opts.max_new_tokens, references=[record["answer"]], stop_ids=stops,
                          uncompressed_tail=tail,
                          extra={"difficulty": record.get("difficulty"), "length": record.get("length"),
                                 "domain": record.get("domain"), "truncated": truncated,
                                 "question_compressed": tail == 0})

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        max_length = opts.max_length or max(2, model_context_length(engine) - opts.max_new_tokens - 64)
        chat = wants_chat_template(opts.chat_template, tokenizer)
        stops = stop_token_ids(tokenizer)
        records = lv2.load_longbench_v2(opts.data_path, opts.limit, opts.revision)
        if not records:
            raise UserError(f"no LongBench v2 items to run (limit {opts.limit})")
        requests = [self.build_request(tokenizer, r, max_length, chat, stops) for r in records]
        outputs, perf = run_generation(engine, tokenizer, requests, batch_size=batch_size_of(cfg), progress=progress,
                                       desc=self.name)
        samples = []
        for out in outputs:
            pred = lv2.extract_answer(out.prediction)
            samples.append(out.record(answer=pred, correct=float(pred == out.request.references[0])))
        metrics = accuracy_table(samples)
        metrics["max_length"] = max_length
        metrics.update(kept_stats(engine))
        return TaskResult(metrics=metrics, samples=samples, perf=perf)


def accuracy_table(samples: list[dict]) -> dict:
    """accuracy overall, by difficulty and by length (100 x mean, 2 decimals; null where no item)."""
    def acc(rows: list[dict]) -> Optional[float]:
        return round(100 * sum(s["correct"] for s in rows) / len(rows), 2) if rows else None

    out = {"accuracy": acc(samples)}
    for d in lv2.DIFFICULTIES:
        out[f"accuracy_{d}"] = acc([s for s in samples if s.get("difficulty") == d])
    for n in lv2.LENGTHS:
        out[f"accuracy_{n}"] = acc([s for s in samples if s.get("length") == n])
    return out
