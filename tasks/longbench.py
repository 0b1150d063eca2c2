"""`task=longbench` and `task=longbench_e`: LongBench v1 (THUDM/LongBench) as its pred.py and eval.py run it.

Per sample (pred.py): the dataset's official prompt filled with the record's context and input; if it is longer than
`max_length` tokens, it is cut in the middle (the first and last max_length/2 tokens, decoded and joined); then the
chat template, except for trec, triviaqa, samsum, lsht, lcc and repobench-p (`chat_template`: auto = when the
tokenizer has one); greedy decoding of at most the dataset's official max new tokens, stopping at EOS (and the chat
end tokens), and for samsum also at "\\n"; the prediction is the new tokens decoded with special tokens skipped.

Scoring (eval.py): the dataset's official metric, max over the reference answers, first line only for trec,
triviaqa, samsum and lsht; per dataset 100 x mean with 2 decimals (`score_<dataset>`); `score` is the mean of the
dataset scores (and `score_en` / `score_zh` per language when both are present). LongBench-E datasets (`<name>_e`)
are also scored per length bucket: `score_<dataset>_<bucket>` and, averaged over the -E datasets,
`score_<bucket>` for the buckets 0-4k, 4-8k, 8k+.

Options:
- datasets     list of dataset names, or one of: all (the 21 v1 datasets), en, zh, e (the 13 LongBench-E sets)
- data_dir     a folder of `<dataset>.jsonl` in the hub's format, or the official data.zip; null = the hub
- limit        at most this many samples per dataset (null = all)
- max_length   prompt tokens kept by the middle truncation (default 7500, for SmolLM2's 8192 positions; null =
               the model's max positions minus 692, which leaves room for 512 new tokens and the chat template)
- chat_template  auto | true | false
- compress_question  true (default, as pred.py: the question is part of the compressed prompt) | false (the
               context is compressed, then the part after it, question and answer cue, is appended uncompressed:
               kvpress's protocol)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvbench.data import longbench as lb
from kvbench.data.hub import check_revision, require_hub
from kvbench.data.longbench import LONGBENCH_E_DATASETS, check_data_dir, check_data_rows, language, load_longbench
from kvbench.errors import UserError
from kvbench.metrics.longbench import LENGTH_BUCKETS, length_bucket, score_sample
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (GenRequest, batch_size_of, check_bool_option, check_chat_template_option,
                                       kept_stats, model_context_length, question_count, run_generation,
                                       stop_token_ids,
                                       template_and_split, wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task
from kvbench.tasks.selection import expand_names

RESERVED_TOKENS = 692  # null max_length = model context minus this (512 new tokens + the chat template)
DATASET_GROUPS = ("all", "en", "zh", "e")


def _dataset_names(value: Any) -> list[str]:
    groups = dict(zip(DATASET_GROUPS, (lb.LONGBENCH_DATASETS, lb.LONGBENCH_EN, lb.LONGBENCH_ZH,
                                       lb.LONGBENCH_E_DATASETS)))
    return expand_names(value, option="datasets", what="LongBench dataset", groups=groups, choices=lb.ALL_DATASETS)


@dataclass
class LongBenchOptions:
    name: str = "longbench"
    datasets: Union[list, str] = field(default_factory=lambda: ["all"])
    data_dir: Optional[str] = None
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    limit: Optional[int] = None
    max_length: Optional[int] = 7500
    chat_template: Any = "auto"
    compress_question: bool = True  # false: the context is compressed, then the question appended uncompressed

    def __post_init__(self) -> None:
        self.datasets = _dataset_names(self.datasets)
        check_revision(self.revision, "data_dir", self.data_dir)
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise UserError(f"invalid task.limit={self.limit!r}: expected an integer >= 1 (samples per dataset) "
                            f"or null (all)")
        check_positive("task.max_length", self.max_length, allow_none=True)
        if self.max_length is not None and self.max_length < 2:
            raise UserError(f"invalid task.max_length={self.max_length!r}: expected an integer >= 2 or null")
        self.chat_template = check_chat_template_option(self.chat_template)
        check_bool_option("task.compress_question", self.compress_question)


def question_part(dataset: str, record: dict) -> str:
    """What the dataset's template puts after the context (the question and the answer cue), filled in."""
    after = lb.prompt_template(dataset).split("{context}", 1)[1]
    return after.format(input=record.get("input", ""))


def build_request(tokenizer: Any, dataset: str, record: dict, max_length: int, chat: bool,
                  stops: tuple[int, ...], compress_question: bool = True) -> GenRequest:
    """One LongBench sample as pred.py prepares it (see the module docstring). compress_question=False: the
    part after the context (the question, the answer cue and the chat turn's end) is appended uncompressed; when
    the middle truncation cut into it, the whole prompt is compressed (`question_compressed` in the sample)."""
    full = lb.build_prompt(dataset, record)
    prompt = lb.truncate_prompt_middle(tokenizer, full, max_length)
    truncated = prompt != full
    templated = chat and lb.uses_chat_template(dataset)
    prompt, ids, tail = template_and_split(tokenizer, prompt, question_part(dataset, record), templated,
                                           compress_question)
    if lb.base_dataset(dataset) == "samsum":  # pred.py: eos_token_id=[eos, the id of "\n"]
        stops = tuple(sorted(set(stops) | {int(tokenizer.encode("\n", add_special_tokens=False)[-1])}))
    rid = record.get("_id")
    return GenRequest(
        id=str(rid) if rid is not None else f"{dataset}-{record.get('_index', 0)}", dataset=dataset, prompt=prompt,
        token_ids=ids, max_new_tokens=lb.max_new_tokens(dataset), references=list(record["answers"]),
        stop_ids=stops, uncompressed_tail=tail,
        question_tokens=question_count(tokenizer, prompt, question_part(dataset, record), templated) if tail == 0
        else 0,
        extra={"length": record.get("length"), "language": record.get("language"), "truncated": truncated,
               "chat_template": templated, "_all_classes": record.get("all_classes"),
               "question_compressed": tail == 0},
    )


def score_results(samples: list[dict], datasets: list[str]) -> dict:
    """Per-dataset scores, their averages and the LongBench-E buckets, from samples that carry `score`."""
    import math

    metrics: dict = {}
    per_dataset: dict[str, float] = {}
    for ds in datasets:
        rows = [s for s in samples if s["dataset"] == ds]
        if not rows:
            continue
        per_dataset[ds] = round(100 * sum(s["score"] for s in rows) / len(rows), 2)
        metrics[f"score_{ds}"] = per_dataset[ds]
        metrics[f"num_samples_{ds}"] = len(rows)
        if ds in LONGBENCH_E_DATASETS:
            for bucket in LENGTH_BUCKETS:
                vals = [s["score"] for s in rows
                        if s.get("length") is not None and length_bucket(s["length"]) == bucket]
                metrics[f"score_{ds}_{bucket}"] = round(100 * sum(vals) / len(vals), 2) if vals else None
    if per_dataset:
        metrics["score"] = round(sum(per_dataset.values()) / len(per_dataset), 2)
        by_lang: dict[str, list[float]] = {}
        for ds, v in per_dataset.items():
            by_lang.setdefault(language(ds), []).append(v)
        if len(by_lang) > 1:
            for lang, vals in sorted(by_lang.items()):
                metrics[f"score_{lang}"] = round(sum(vals) / len(vals), 2)
    e_sets = [ds for ds in per_dataset if ds in LONGBENCH_E_DATASETS]
    for bucket in LENGTH_BUCKETS:
        vals = [metrics[f"score_{ds}_{bucket}"] for ds in e_sets if metrics.get(f"score_{ds}_{bucket}") is not None]
        if e_sets:
            metrics[f"score_{bucket}"] = round(sum(vals) / len(vals), 2) if vals else None
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


@register_task("longbench")
class LongBench(Task):

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)
    Options = LongBenchOptions

    def workload(self, settings: Any) -> Optional[Workload]:
        """`limit` samples per dataset (else, for a local task.data_dir, its rows), each at most max_length prompt
        tokens and its dataset's official generation length; None when neither the rows nor max_length are known
        before the data loads (hub data without a limit, max_length null)."""
        opts = self.options
        if opts.max_length is None:
            return None
        names = _dataset_names(opts.datasets)
        if opts.limit is not None:
            rows = {ds: opts.limit for ds in names}
        elif opts.data_dir is not None:
            try:
                rows = {ds: lb.count_rows(ds, opts.data_dir) for ds in names}
            except (OSError, ValueError):
                return None
        else:
            return None
        prompts = sum(rows.values())
        return Workload(prompts, prompts * opts.max_length, sum(n * lb.max_new_tokens(ds) for ds, n in rows.items()),
                        f"{len(names)} LongBench dataset(s), {prompts:,} sample(s)",
                        "task.limit=N, task.datasets=[...], task.max_length=N", exact=False)

    def preflight(self, settings: Any, model_shape: Any) -> None:
        """Before the model loads: task.data_dir holds every dataset's file, each row the run reads of LongBench's
        types (file:line and field named otherwise), or (null) the hub is reachable; max_length and the tokens a
        dataset generates within the model's positions (the chat template's few tokens are the engine's check)."""
        limit = getattr(model_shape, "max_positions", None)
        longest = max(lb.max_new_tokens(ds) for ds in self.options.datasets)
        if limit and self.options.max_length is not None and self.options.max_length + longest > limit:
            raise UserError(f"invalid task.max_length={self.options.max_length}: with the {longest} tokens "
                            f"{', '.join(ds for ds in self.options.datasets if lb.max_new_tokens(ds) == longest)} "
                            f"generates, past the model's {limit} positions; expected at most {limit - longest}"
                            + (f", or null (the model's positions minus {RESERVED_TOKENS})"
                               if limit > RESERVED_TOKENS + 2 else ""))
        if self.options.data_dir is not None:
            check_data_dir(self.options.data_dir, self.options.datasets)
            check_data_rows(self.options.data_dir, self.options.datasets, self.options.limit)
        else:
            require_hub("LongBench data", "task.data_dir")

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        max_length = opts.max_length or max(2, model_context_length(engine) - RESERVED_TOKENS)
        chat = wants_chat_template(opts.chat_template, tokenizer)
        stops = stop_token_ids(tokenizer)
        requests: list[GenRequest] = []
        for ds in opts.datasets:
            try:
                records = load_longbench(ds, data_dir=opts.data_dir, limit=opts.limit, revision=opts.revision)
            except FileNotFoundError as exc:
                raise UserError(f"LongBench data for {ds!r} not found: {exc}") from None
            except ValueError as exc:  # a row of the hub's that is not of LongBench's types (file:line, field)
                raise UserError(f"LongBench data for {ds!r}: {exc}") from None
            for i, rec in enumerate(records):
                rec.setdefault("_index", i)
                if rec.get("_id") is None:
                    rec["_id"] = f"{ds}-{i}"
                requests.append(build_request(tokenizer, ds, rec, max_length, chat, stops, opts.compress_question))
        if not requests:
            raise UserError(f"no LongBench samples to run (datasets {', '.join(opts.datasets)}, limit {opts.limit})")
        outputs, perf = run_generation(engine, tokenizer, requests, batch_size=batch_size_of(cfg), progress=progress,
                                       desc=self.name)
        samples = []
        for out in outputs:
            classes = out.request.extra.get("_all_classes")
            score = score_sample(out.request.dataset, out.prediction, out.request.references, classes)
            rec = out.record(score=score)
            rec.pop("_all_classes", None)
            samples.append(rec)
        metrics = score_results(samples, opts.datasets)
        metrics["max_length"] = max_length
        metrics.update(kept_stats(engine))
        return TaskResult(metrics=metrics, samples=samples, perf=perf)


@dataclass
class LongBenchEOptions(LongBenchOptions):
    name: str = "longbench_e"
    datasets: Union[list, str] = field(default_factory=lambda: ["e"])


@register_task("longbench_e")
class LongBenchE(LongBench):
    """LongBench-E: the length-balanced subsets, scored per length bucket as well."""

    Options = LongBenchEOptions
