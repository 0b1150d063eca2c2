"""`task=gsm8k`, `task=math500`, `task=aime`: reasoning benchmarks, where the cache grows while the model thinks.

Per problem (kvbench.data.reasoning): the reasoning prompt (`prompt_style`: r1 = DeepSeek-R1's "Please reason step
by step, and put your final answer within \\boxed{}.", rkv = R-KV's run_math.py template) in the model's chat
template (`chat_template`: auto = when the tokenizer has one); `num_samples` generations of at most
`max_new_tokens` new tokens, stopping at EOS (and the chat end tokens), sampled with `temperature` 0.6 and `top_p`
0.95 (DeepSeek-R1's setting), or greedy (`greedy=true`); `ignore_eos=true` generates exactly max_new_tokens (the
smoke experiment's long trace on a model too small to reason).

Scoring (kvbench.metrics.reasoning): gsm8k as lm-eval's gsm8k (strict "#### N" and flexible last-number extraction,
both reported: `strict_match`, `flexible_extract`; `accuracy` is the flexible one, since reasoning prompts end in
a boxed answer, not "####"); math500 and aime with math-verify (`accuracy`). Accuracy is pass@1 averaged over the
samples: per problem the mean over its samples, then the mean over problems, x 100.

Memory while generating (from the sequence's block tables after every step, after the method evicted):
  output_tokens_mean        mean new tokens per generation
  max_table_tokens          the most tokens any (layer, kv-head) table of any sequence held after a step
  kv_tokens_kept_end_mean   tokens per table (mean over layers and kv-heads) at each generation's last token
  kv_bytes_peak_sequence    the most KV bytes one sequence held (its blocks x bytes per block)
and in the run folder `kv_curve.csv`: id, sample, new_tokens, max_table_tokens, mean_table_tokens, kv_bytes, every
`curve_every` generated tokens (and at the last): kvbench-report draws KV over generated tokens from it.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from kvbench.data import reasoning as rd
from kvbench.data.hub import check_revision, require_hub
from kvbench.errors import UserError
from kvbench.metrics.reasoning import gsm8k_scores, math_verify_score
from kvbench.runtime.model import distributed
from kvbench.runtime.serving.engine import Generation
from kvbench.runtime.serving.requests import Request
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (PerfMeter, apply_chat, batch_size_of, check_bool_option,
                                       check_chat_template_option, decode, encode, stop_token_ids,
                                       wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task

CURVE_FILE = "kv_curve.csv"
CURVE_COLUMNS = ("id", "sample", "new_tokens", "max_table_tokens", "mean_table_tokens", "kv_bytes")
AIME_SETS = {"2024": "aime24", "2025": "aime25"}
MAX_NEW_TOKENS = 32768  # R-KV's longest (AIME)
PROMPT_TOKENS_BOUND = 1024  # a bound on one problem's prompt (statement and template) for the time estimate only


def _check_number(where: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise UserError(f"invalid {where}={value!r}: expected a number in {'(' if lo_open else '['}{lo}, {hi}]")


@dataclass
class ReasoningOptions:
    name: str = "math500"
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    data_path: Optional[str] = None  # a local copy in the hub's layout (folder or file); null = the hub
    limit: Optional[int] = None  # problems (null = all)
    num_samples: int = 1  # generations per problem (pass@1 averaged over them)
    temperature: float = 0.6
    top_p: float = 0.95
    greedy: bool = False  # true: argmax decoding (temperature and top_p unused)
    max_new_tokens: Optional[int] = None  # null: 32,768 or what the model's positions leave after the prompt
    prompt_style: str = "r1"
    chat_template: Any = "auto"
    curve_every: int = 16  # generated tokens between points of kv_curve.csv
    ignore_eos: bool = False  # true: generate exactly max_new_tokens (a memory smoke test: a long trace)

    def __post_init__(self) -> None:
        check_revision(self.revision, "data_path", self.data_path)
        if self.limit is not None:
            check_positive("task.limit", self.limit)
        check_positive("task.num_samples", self.num_samples)
        check_positive("task.max_new_tokens", self.max_new_tokens, allow_none=True)
        check_positive("task.curve_every", self.curve_every)
        _check_number("task.temperature", self.temperature, 0.0, 100.0)
        _check_number("task.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_bool_option("task.greedy", self.greedy)
        check_bool_option("task.ignore_eos", self.ignore_eos)
        if self.prompt_style not in rd.PROMPT_STYLES:
            raise UserError(f"invalid task.prompt_style={self.prompt_style!r}: choose one of "
                            f"{', '.join(rd.PROMPT_STYLES)}")
        self.chat_template = check_chat_template_option(self.chat_template)


class ReasoningTask(Task):
    """Shared run of the reasoning tasks; subclasses say which sets they load and how a prediction scores."""

    Options = ReasoningOptions

    def set_names(self) -> list[str]:
        return [self.name]

    def set_path(self, name: str) -> Optional[str]:
        return self.options.data_path

    def score(self, prediction: str, record: dict) -> dict:
        return math_verify_score(prediction, record["answer"])

    def workload(self, settings: Any) -> Optional[Workload]:
        """`limit` problems per set x num_samples generations of at most max_new_tokens (MAX_NEW_TOKENS when
        null: the model's positions may leave fewer), each prompt at most PROMPT_TOKENS_BOUND; None without a
        limit (the sets' sizes are known once read)."""
        opts = self.options
        if opts.limit is None:
            return None
        sets = self.set_names()
        prompts = opts.limit * len(sets) * opts.num_samples
        new = opts.max_new_tokens or MAX_NEW_TOKENS
        return Workload(prompts, prompts * PROMPT_TOKENS_BOUND, prompts * new,
                        f"up to {opts.limit} problem(s) of {', '.join(sets)} x {opts.num_samples} sample(s)",
                        "task.limit=N, task.max_new_tokens=N", exact=False)

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: the data is reachable and max_new_tokens fits the model's positions."""
        opts = self.options
        limit = getattr(model_shape, "max_positions", None)
        if limit and opts.max_new_tokens is not None and opts.max_new_tokens >= limit:
            raise UserError(f"invalid task.max_new_tokens={opts.max_new_tokens}: the model has {limit} positions, "
                            f"which must hold the prompt and the new tokens (use at most {limit - 256} or so)")
        for name in self.set_names():
            path = self.set_path(name)
            if path is not None:
                rd.check_local(name, path)
            else:
                require_hub(f"{name} data", "task.data_path")

    # ------------------------------------------------------------------------------------------ run
    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        records = [r for name in self.set_names() for r in rd.load_reasoning(name, self.set_path(name), opts.limit, opts.revision)]
        if not records:
            raise UserError(f"no {self.name} problems to run (limit {opts.limit})")
        chat = wants_chat_template(opts.chat_template, tokenizer)
        stops = stop_token_ids(tokenizer)
        positions = getattr(getattr(engine.model, "config", None), "max_position_embeddings", None)
        jobs = []  # (record, sample index, prompt text, token ids)
        for rec in records:
            text = rd.reasoning_prompt(rec["question"], opts.prompt_style)
            prompt = apply_chat(tokenizer, text) if chat else text
            ids = encode(tokenizer, prompt, chat)
            new = opts.max_new_tokens or min(MAX_NEW_TOKENS, (positions or MAX_NEW_TOKENS + len(ids)) - len(ids))
            if new < 1 or (positions and len(ids) + new > positions):
                raise UserError(f"problem {rec['id']}: {len(ids)} prompt tokens + task.max_new_tokens={new} "
                                f"exceed the model's {positions} positions")
            jobs += [(rec, s, prompt, ids, new) for s in range(opts.num_samples)]
        temperature = 0.0 if opts.greedy else float(opts.temperature)
        meter = PerfMeter()
        batch = batch_size_of(cfg)
        # A data-parallel launch deals whole batches over its ranks: each batch keeps its members and its seed
        # (seed + its first job's index), so every generation, sampled ones included, is the one-process one.
        starts = distributed.shard(range(0, len(jobs), batch))  # [(batch index, first job index)] of this rank
        bar = progress(total=sum(len(jobs[s:s + batch]) for _, s in starts), desc=self.name, unit="generation")
        seed = int(getattr(cfg, "seed", 0) or 0)
        done = []  # (batch index, (samples, curve rows)) of this rank
        try:
            for b, start in starts:
                part, curve = jobs[start:start + batch], []
                done.append((b, (self._generate(engine, tokenizer, part, stops, temperature, seed + start, meter,
                                                curve), curve)))
                bar.update(len(part))
        finally:
            bar.close()
        perf = meter.perf(engine)
        if distributed.current() is not None:
            perf["samples_computed"] = sum(len(out) for _, (out, _) in done)
        every = distributed.gather_in_order(done)  # every rank's batches, in batch order
        samples = [s for out, _ in every for s in out]
        self._write_curve([row for _, curve in every for row in curve])
        return TaskResult(metrics=self._metrics(samples), samples=samples, perf=perf)

    def _generate(self, engine: Any, tokenizer: Any, part: list, stops: tuple, temperature: float, seed: int,
                  meter: PerfMeter, curve: list) -> list[dict]:
        opts = self.options
        reqs = [Request(list(ids), new, index=i, ignore_eos=opts.ignore_eos) for i, (_, _, _, ids, new) in enumerate(part)]
        last: dict[int, dict] = {}
        peak: dict[int, dict] = {}

        def on_token(r: Request) -> None:  # after every generated token, before a finished sequence is freed
            held = engine.sequence_kv(r.slot)
            last[r.index] = held
            p = peak.setdefault(r.index, dict(held))
            p["max_table_tokens"] = max(p["max_table_tokens"], held["max_table_tokens"])
            p["kv_bytes"] = max(p["kv_bytes"], held["kv_bytes"])
            n = len(r.output)
            if n % opts.curve_every == 0 or n >= r.max_new_tokens or (r.output[-1] in stops and not r.ignore_eos):
                rec, s = part[r.index][0], part[r.index][1]
                curve.append((rec["id"], s, n, held["max_table_tokens"], round(held["mean_table_tokens"], 2),
                              held["kv_bytes"]))

        engine.serve(reqs, stop_token_ids=stops, temperature=temperature, top_p=float(opts.top_p), seed=seed,
                     on_token=on_token)
        failed = [r for r in reqs if r.finish_reason == "failed"]
        if failed:
            raise UserError(f"{failed[0].error} (problem {part[failed[0].index][0]['id']})")
        gens = [Generation(r.output, r.finish_reason, r.first_token_s if r.first_token_s is not None else 0.0,
                           r.prefill_tokens, r.prefill_s, r.decode_tokens, r.decode_s, r.preemptions, r.error)
                for r in reqs]
        meter.add_batch(gens)
        out = []
        for r, g, (rec, s, prompt, ids, _) in zip(reqs, gens, part):
            prediction = decode(tokenizer, g.token_ids)
            held, top = last.get(r.index, {}), peak.get(r.index, {})
            out.append({
                "id": rec["id"], "dataset": rec["set"], "sample": s, "prompt": prompt, "prediction": prediction,
                "references": [rec["answer"]], "prompt_tokens": len(ids), "new_tokens": len(g.token_ids),
                "finish_reason": g.finish_reason, "ttft_s": g.ttft_s, "prefill_s": g.prefill_s,
                "decode_s": g.decode_s, "max_table_tokens": top.get("max_table_tokens"),
                "kv_tokens_kept_end": held.get("mean_table_tokens"), "kv_bytes_peak": top.get("kv_bytes"),
                **self.score(prediction, rec)})
        return out

    def headline(self, sample: dict) -> float:
        return sample["correct"]

    def _metrics(self, samples: list[dict]) -> dict:
        by_problem: dict[str, list[dict]] = {}
        for s in samples:
            by_problem.setdefault(s["id"], []).append(s)

        def pass_at_1(key: Any) -> float:
            per = [sum(key(s) for s in rows) / len(rows) for rows in by_problem.values()]
            return round(100 * sum(per) / len(per), 2)

        def mean(key: str) -> Optional[float]:
            vals = [s[key] for s in samples if s.get(key) is not None]
            return round(sum(vals) / len(vals), 2) if vals else None

        metrics = {"accuracy": pass_at_1(self.headline), "num_problems": len(by_problem),
                   "samples_per_problem": self.options.num_samples,
                   "output_tokens_mean": mean("new_tokens"),
                   "truncated_fraction": round(sum(s["finish_reason"] == "length" for s in samples) / len(samples), 4),
                   "max_table_tokens": max((s["max_table_tokens"] or 0) for s in samples),
                   "kv_tokens_kept_end_mean": mean("kv_tokens_kept_end"),
                   "kv_bytes_peak_sequence": max((s["kv_bytes_peak"] or 0) for s in samples)}
        metrics.update(self.extra_metrics(samples, pass_at_1))
        return metrics

    def extra_metrics(self, samples: list[dict], pass_at_1: Any) -> dict:
        return {}

    def _write_curve(self, curve: list) -> None:
        folder = getattr(self, "output_dir", None)
        if not folder:
            return
        with open(os.path.join(folder, CURVE_FILE), "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(CURVE_COLUMNS)
            w.writerows(curve)


@dataclass
class GSM8KOptions(ReasoningOptions):
    name: str = "gsm8k"


@register_task("gsm8k")
class GSM8K(ReasoningTask):
    """GSM8K (openai/gsm8k test), scored as lm-eval's gsm8k: strict and flexible extraction."""

    Options = GSM8KOptions

    def score(self, prediction: str, record: dict) -> dict:
        return gsm8k_scores(prediction, record["answer"])

    def headline(self, sample: dict) -> float:
        return sample["flexible_extract"]

    def extra_metrics(self, samples: list[dict], pass_at_1: Any) -> dict:
        return {"strict_match": pass_at_1(lambda s: s["strict_match"]),
                "flexible_extract": pass_at_1(lambda s: s["flexible_extract"])}


@dataclass
class Math500Options(ReasoningOptions):
    name: str = "math500"


@register_task("math500")
class Math500(ReasoningTask):
    """MATH-500 (HuggingFaceH4/MATH-500), scored with math-verify."""

    Options = Math500Options


def _aime_sets(value: Any) -> list[str]:
    items = [value] if isinstance(value, (str, int)) else list(value or [])
    if not items:
        raise UserError("task.sets is empty: choose from 2024, 2025")
    out = []
    for item in items:
        key = str(item)
        if key not in AIME_SETS:
            raise UserError(f"unknown AIME set {item!r} in task.sets: choices are {', '.join(AIME_SETS)}")
        if AIME_SETS[key] not in out:
            out.append(AIME_SETS[key])
    return out


@dataclass
class AIMEOptions(ReasoningOptions):
    name: str = "aime"
    sets: Union[list, str, int] = field(default_factory=lambda: ["2024"])

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sets = _aime_sets(self.sets)
        if self.revision is not None and len(self.sets) > 1:
            raise UserError(f"task.revision={self.revision!r} names one revision but task.sets={list(self.sets)} "
                            f"reads {len(self.sets)} hub datasets: run one set per revision")


@register_task("aime")
class AIME(ReasoningTask):
    """AIME 2024 (HuggingFaceH4/aime_2024, R-KV's set) and / or 2025 (math-ai/aime25, kvpress's), math-verify.
    With both sets and a local copy, `data_path` holds one folder per set (aime24/, aime25/)."""

    Options = AIMEOptions

    def set_names(self) -> list[str]:
        return list(self.options.sets)

    def set_path(self, name: str) -> Optional[str]:
        path = self.options.data_path
        if path is not None and len(self.options.sets) > 1:
            return os.path.join(os.path.expanduser(str(path)), name)
        return path
