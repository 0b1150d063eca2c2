"""`task=ruler`: RULER's 13 tasks (NVIDIA/RULER) at `lengths` tokens, as kvpress's leaderboard runs them.

Data (`source`):
  generate (default)  samples made here, offline and deterministically (`seed`), from RULER's definitions fitted to
                      each length in the model's tokenizer (kvbench.data.ruler); qa_1 / qa_2 need RULER's squad.json
                      / hotpotqa.json in `data_dir` and are skipped, with one line saying so, when absent
  hub                 kvpress's pre-generated dataset (simonjegou/ruler, one subset per length, fitted with
                      Llama-3.1's tokenizer), from `data_dir` (`<length>.parquet|.jsonl` or a `<length>/` folder
                      in the hub's layout) or from the hub
Each sample has a context, a question and an answer prefix. The prompt is built as kvpress's pipeline builds it: with
a chat template (`chat_template`: auto = when the tokenizer has one) the context is the user turn's start and the
question is followed by the turn's end, the assistant header and the answer prefix; without one, the question, a
newline and the answer prefix. `compress_question=false` (default, kvpress's protocol): the context is prefilled and
compressed, then the question part is appended uncompressed; true (kvpress's query-aware loop, evaluate.py
`query_aware`): the context and the question are compressed together (the question is the method's window: Finch's),
then the turn's end and the answer prefix are appended uncompressed (`compress_answer_prefix=true`: they are
compressed too, the window the question and them). The parts are tokenized apart, as kvpress's Finch delimiter and
its pipeline's question suffix split them.
Greedy decoding of at most the task's RULER tokens to generate (`max_new_tokens` overrides), stopping at EOS.

Scoring (kvbench.metrics.ruler): string_match_all, string_match_part for qa_*; metrics `score_<task>` (100 x mean
over samples and lengths), `score` (the average over the tasks run, named in `score_tasks`; the tasks asked for but
skipped in `score_tasks_skipped`), and with several lengths `score_<task>_<length>` and `score_<length>`; `kv_tokens_kept_mean` / `kv_kept_fraction`: tokens kept per layer and kv-head after each
prompt's compression.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from kvbench.data import ruler as rd
from kvbench.data.hub import check_revision, require_hub
from kvbench.data.ruler import TASK_NAMES
from kvbench.errors import UserError
from kvbench.metrics.ruler import metric_for, postprocess
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (GenRequest, apply_chat, batch_size_of, check_bool_option,
                                       check_chat_template_option, encode, kept_stats,
                                       model_context_length, run_generation, split_prompt, split_question,
                                       stop_token_ids,
                                       wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task
from kvbench.tasks.selection import expand_names

SOURCES = ("generate", "hub")
_SAID: set = set()  # skip lines already printed by this process


def _task_names(value: Any) -> list[str]:
    return expand_names(value, option="tasks", what="RULER task", groups={"all": TASK_NAMES}, choices=TASK_NAMES)


@dataclass
class RulerOptions:
    name: str = "ruler"
    tasks: Union[list, str] = field(default_factory=lambda: ["all"])
    lengths: list = field(default_factory=lambda: [4096])
    limit: Optional[int] = None  # samples per task and length (null: all of the data; 500 generated, as RULER)
    source: str = "generate"
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    data_dir: Optional[str] = None  # hub: kvpress's files; generate: RULER's squad.json / hotpotqa.json
    seed: int = 42  # RULER's random_seed
    max_new_tokens: Optional[int] = None  # null: each task's RULER tokens to generate
    chat_template: Any = "auto"
    compress_question: bool = False  # kvpress: the question is appended after the context was compressed
    # with compress_question: true compresses the turn's end and the answer prefix too (kvpress: appended after)
    compress_answer_prefix: bool = False

    def __post_init__(self) -> None:
        self.tasks = _task_names(self.tasks)
        if not self.lengths:
            raise UserError("task.lengths needs at least one length")
        for n in self.lengths:
            check_positive("task.lengths[]", n)
        self.lengths = list(dict.fromkeys(self.lengths))
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise UserError(f"invalid task.limit={self.limit!r}: expected an integer >= 1 or null")
        if self.source not in SOURCES:
            raise UserError(f"invalid task.source={self.source!r}: choices are {', '.join(SOURCES)}")
        if self.revision is not None and self.source != "hub":
            raise UserError(f"task.revision is set but task.source={self.source!r} reads no hub data: "
                            f"revision is for task.source=hub")
        check_revision(self.revision, "data_dir", self.data_dir)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"invalid task.seed={self.seed!r}: expected an integer >= 0")
        check_positive("task.max_new_tokens", self.max_new_tokens, allow_none=True)
        self.chat_template = check_chat_template_option(self.chat_template)
        check_bool_option("task.compress_question", self.compress_question)
        check_bool_option("task.compress_answer_prefix", self.compress_answer_prefix)
        if self.compress_answer_prefix and not self.compress_question:
            raise UserError("task.compress_answer_prefix=true needs task.compress_question=true (without it the "
                            "question, the turn's end and the answer prefix are all appended uncompressed)")


def ruler_prompt(tokenizer: Any, sample: dict, chat: bool) -> tuple[str, int, int]:
    """The prompt text of a sample, where its question starts and where it ends (the turn's end and the answer
    prefix follow: kvpress's pipeline.preprocess)."""
    context, question, prefix = sample["context"], sample["question"], sample["answer_prefix"]
    if chat:
        separator = "#" * (len(context) + 10)  # a string the text cannot hold, to find the turn's end
        templated = apply_chat(tokenizer, context + separator)
        head, suffix = templated.split(separator)
    else:
        head, suffix = context, "\n"
    return head + question + suffix + prefix, len(head), len(head) + len(question)


def build_request(tokenizer: Any, sample: dict, length: int, chat: bool, compress_question: bool,
                  max_new_tokens: Optional[int], stops: tuple[int, ...],
                  compress_answer_prefix: bool = False) -> GenRequest:
    """One sample's request; see the module docstring for the three protocols (query-agnostic, query-aware with the
    turn's end and answer prefix appended after compression, or compressed with them)."""
    prompt, question_start, question_end = ruler_prompt(tokenizer, sample, chat)
    question = 0
    if not compress_question:  # the question part appended uncompressed after the compressed context
        ids, tail = split_prompt(tokenizer, prompt, question_start, chat)
    elif compress_answer_prefix:  # the whole prompt compressed; the window: the question part
        ids, tail = encode(tokenizer, prompt, chat), 0
        question = split_prompt(tokenizer, prompt, question_start, chat)[1]
    else:  # kvpress's query-aware loop: context + question compressed, the turn's end + answer prefix after
        ids, question, tail = split_question(tokenizer, prompt, question_start, question_end, chat)
    return GenRequest(
        id=f"{sample['task']}-{length}-{sample['index']}", dataset=sample["task"], prompt=prompt, token_ids=ids,
        max_new_tokens=max_new_tokens or int(sample["max_new_tokens"]), references=list(sample["answer"]),
        stop_ids=stops, uncompressed_tail=tail, question_tokens=question, extra={"length": length, "answer_prefix": sample["answer_prefix"]})


def score_results(samples: list[dict], tasks: list[str], lengths: list[int]) -> dict:
    """score_<task> (100 x mean over its samples), score (mean over tasks), per length when several; `score_tasks`
    names the tasks `score` averages (comma-separated, in task order) and `score_tasks_skipped` those asked for
    that have no samples (qa_1 / qa_2 without their data), so an 11-task score never passes for a 13-task one."""
    metrics: dict = {}
    per_task: dict[str, float] = {}
    for t in tasks:
        rows = [s["score"] for s in samples if s["dataset"] == t]
        if rows:
            per_task[t] = metrics[f"score_{t}"] = round(100 * sum(rows) / len(rows), 2)
            metrics[f"num_samples_{t}"] = len(rows)
    if per_task:
        metrics["score"] = round(sum(per_task.values()) / len(per_task), 2)
        metrics["score_tasks"] = ",".join(per_task)
        skipped = [t for t in tasks if t not in per_task]
        if skipped:
            metrics["score_tasks_skipped"] = ",".join(skipped)
    if len(lengths) > 1:
        for n in lengths:
            by_task = []
            for t in per_task:
                rows = [s["score"] for s in samples if s["dataset"] == t and s["length"] == n]
                if rows:
                    metrics[f"score_{t}_{n}"] = round(100 * sum(rows) / len(rows), 2)
                    by_task.append(metrics[f"score_{t}_{n}"])
            if by_task:
                metrics[f"score_{n}"] = round(sum(by_task) / len(by_task), 2)
    return metrics


@register_task("ruler")
class Ruler(Task):

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)
    Options = RulerOptions

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: lengths within the model's positions and long enough for a sample of every
        task, the data present (hub: task.data_dir's files for every length, or the hub reachable; generate: the
        QA tasks' files, a task without them skipped with one line now, and refused when nothing would run)."""
        opts = self.options
        limit = getattr(model_shape, "max_positions", None)
        too_long = [n for n in opts.lengths if limit and n > limit]
        if too_long:
            raise UserError(f"invalid task.lengths={too_long}: past the model's {limit} positions; expected lengths "
                            f"of at most {limit}")
        for t in opts.tasks:
            need = rd.fewest_tokens(t)
            short = [n for n in opts.lengths if n < need]
            if short:
                raise UserError(f"invalid task.lengths={short}: no room for a {t} sample (at least {need} tokens: "
                                f"its prompt without a haystack and {rd.tokens_to_generate(t)} to generate); "
                                f"expected lengths of at least {max(rd.fewest_tokens(x) for x in opts.tasks)}")
        if opts.source == "hub":
            self._check_hub_data(limit)
            return
        missing = {t: why for t in opts.tasks if (why := rd.qa_data_missing(t, opts.data_dir))}
        if len(missing) == len(opts.tasks):
            raise UserError(f"task.tasks={list(opts.tasks)}: nothing to run: "
                            + "; ".join(f"{t} needs {why}" for t, why in missing.items()))
        for t, why in missing.items():
            line = f"kvbench: ruler: {t} skipped: it needs {why}"
            if line not in _SAID:  # once per process: a sweep checks every job before the first starts
                _SAID.add(line)
                print(line, file=sys.stderr, flush=True)
        self.skipped = set(missing)

    def workload(self, settings: Any) -> Workload:
        """tasks x samples x lengths prompts; each is about its length in tokens (tokens to generate included)."""
        opts = self.options
        per = opts.limit or (500 if opts.source == "generate" else None)
        tasks = [t for t in opts.tasks if t not in getattr(self, "skipped", ())]
        n = len(tasks) * len(opts.lengths) * (per or 500)
        gen = sum(opts.max_new_tokens or rd.tokens_to_generate(t) for t in tasks) * len(opts.lengths) * (per or 500)
        prompt = sum(length * (per or 500) for length in opts.lengths) * len(tasks) - gen
        return Workload(n, max(prompt, 0), gen,
                        f"{len(tasks)} task(s) x {per or 'up to 500'} samples x lengths {list(opts.lengths)}",
                        "task.limit=N (samples per task and length), task.tasks=[...], task.lengths=[...]",
                        exact=per is not None)

    def _check_hub_data(self, limit: Optional[int] = None) -> None:
        """task.data_dir's files for every length, every row well formed and within `limit` positions (the model's),
        or the hub reachable."""
        opts = self.options
        if not opts.data_dir:
            require_hub("RULER data (simonjegou/ruler)", "task.data_dir")
            return
        if not os.path.isdir(opts.data_dir):
            raise UserError(f"invalid task.data_dir={opts.data_dir!r}: no such folder (task.source=hub reads "
                            "kvpress's <length>.parquet|.jsonl or <length>/ files from it)")
        for n in opts.lengths:
            try:
                rd.local_files(Path(opts.data_dir), n)
            except FileNotFoundError as exc:
                raise UserError(f"invalid task.data_dir={opts.data_dir!r}: {exc} (task.lengths={list(opts.lengths)})"
                                ) from None
        try:
            rd.check_local_rows(Path(opts.data_dir), opts.lengths)  # every row's types, before the model loads
        except (ValueError, OSError) as exc:
            raise UserError(f"task.data_dir file {exc}") from None
        if limit:
            self._check_row_lengths(limit)

    def _check_row_lengths(self, limit: int) -> None:
        """Rows that cannot fit the model's positions, found without a tokenizer (before the model loads): a token
        per word of the prompt (no token spans a space; the chat template only adds) and the tokens to generate.
        Rows made with another tokenizer can pass their nominal length; those past the bound in this one are the
        engine's refusal."""
        opts = self.options
        for n in opts.lengths:
            for t, rows in rd.load_hub_samples(n, opts.tasks, opts.data_dir, opts.limit).items():
                for r in rows:
                    new = opts.max_new_tokens or int(r["max_new_tokens"])
                    need = len((r["context"] + r["question"] + "\n" + r["answer_prefix"]).split()) + new
                    if need > limit:
                        raise UserError(f"invalid task.data_dir={opts.data_dir!r}: its RULER {t} sample "
                                        f"{r['index'] + 1} at length {n} needs at least {need} tokens (a token per "
                                        f"word of its prompt and {new} to generate), past the model's {limit} "
                                        f"positions; expected data for lengths within them")

    def samples_for(self, tokenizer: Any, length: int, on_sample: Any = None) -> dict[str, list[dict]]:
        """The samples of every task at one length; a QA task without its data is skipped with one line.
        `on_sample()` is called after each generated sample (progress)."""
        opts = self.options
        if opts.source == "hub":
            try:
                return rd.load_hub_samples(length, opts.tasks, opts.data_dir, opts.limit, opts.revision)
            except (FileNotFoundError, ValueError) as exc:
                raise UserError(f"RULER data for length {length}: {exc}") from None
        out: dict[str, list[dict]] = {}
        for t in opts.tasks:
            if t in getattr(self, "skipped", ()):  # said by preflight
                continue
            try:
                out[t] = rd.generate_samples(t, length, tokenizer, opts.limit or 500, opts.seed, opts.data_dir,
                                             on_sample=on_sample)
            except FileNotFoundError as exc:
                print(f"kvbench: ruler: {t} skipped: it needs RULER's {rd.QA_FILES[rd.QA_TASKS[t]]} in "
                      f"task.data_dir ({exc})", file=sys.stderr, flush=True)
            except ImportError as exc:
                raise UserError(f"task=ruler: {exc}") from None
            except ValueError as exc:
                raise UserError(f"task=ruler: {t} at {length} tokens: {exc}") from None
        return out

    def requests(self, tokenizer: Any, engine: Any = None, progress: Any = None) -> list[GenRequest]:
        """The prompts of every task and length (generated samples are made here: a progress bar counts them)."""
        opts = self.options
        if engine is not None:
            limit = model_context_length(engine)
            too_long = [n for n in opts.lengths if n > limit]
            if too_long:
                raise UserError(f"task.lengths {too_long} exceed the model's {limit} positions")
        chat = wants_chat_template(opts.chat_template, tokenizer)
        stops = stop_token_ids(tokenizer)
        out = []
        bar = None
        if progress is not None and opts.source == "generate":
            runnable = [t for t in opts.tasks if t not in getattr(self, "skipped", ())]
            bar = progress(total=len(runnable) * len(opts.lengths) * (opts.limit or 500), desc="ruler: making samples",
                           unit="sample")
        for n in opts.lengths:
            for t, rows in self.samples_for(tokenizer, n, None if bar is None else bar.update).items():
                out += [build_request(tokenizer, r, n, chat, opts.compress_question, opts.max_new_tokens, stops,
                                      opts.compress_answer_prefix)
                        for r in rows]
        if bar is not None:
            bar.close()
        return out

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        requests = self.requests(tokenizer, engine, progress)
        if not requests:
            raise UserError(f"no RULER samples to run (tasks {', '.join(opts.tasks)})")
        outputs, perf = run_generation(engine, tokenizer, requests, batch_size=batch_size_of(cfg), progress=progress,
                                       desc=self.name)
        samples = []
        for out in outputs:
            score = metric_for(out.request.dataset)(postprocess(out.prediction), out.request.references)
            samples.append(out.record(score=score))
        metrics = score_results(samples, opts.tasks, opts.lengths)
        metrics.update(kept_stats(engine))
        return TaskResult(metrics=metrics, samples=samples, perf=perf)
