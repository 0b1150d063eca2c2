"""`task=summarization`: the packaged ACLSum papers (offline), the embedded stand-in for GovReport.

Per paper: the body (pdf_parse paragraphs, abstract left out) goes into `prompt` (fields {document} and {title});
a prompt longer than `max_length` tokens is cut in the middle as LongBench does (first and last max_length/2 tokens);
then the chat template (`chat_template`: auto = when the tokenizer has one); greedy decoding of at most
`max_new_tokens`, stopping at EOS and the chat end tokens.

Scored against the human summaries (`reference`: aspects = challenge, approach and outcome summaries joined by
newlines; abstract; both = max over the two) with the ROUGE set of the GovReport task: `rouge_l` (the official
LongBench ROUGE-L, `rouge` package) and rouge-score's `rouge1`, `rouge2`, `rougeL`, `rougeLsum` (F-measures with
stemming), each 100 x mean with 2 decimals; per sample in [0, 1].

Options: split (train | val | test), limit (null = the whole split), reference, prompt, max_length,
max_new_tokens, chat_template.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvbench.data.aclsum import REFERENCE_CHOICES, SPLITS, load_aclsum
from kvbench.data.longbench import truncate_prompt_middle
from kvbench.errors import UserError
from kvbench.metrics.rouge import mean_scores, summarization_scores
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import (GenRequest, apply_chat, batch_size_of, check_chat_template_option,
                               encode, run_generation, stop_token_ids, wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task

DEFAULT_PROMPT = (
    "You are given a scientific paper. Write a short summary of the paper in three sentences: the problem it "
    "addresses, the approach it takes, and its outcome.\n\nPaper:\n{document}\n\n"
    "Now, write a three-sentence summary of the paper.\n\nSummary:"
)
ROUGE_KEYS = ("rouge_l", "rouge1", "rouge2", "rougeL", "rougeLsum")


def check_limit(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"invalid task.limit={value!r}: expected an integer >= 1 (documents) or null (all)")


def check_max_length(value: Any) -> None:
    check_positive("task.max_length", value)
    if value < 2:
        raise UserError(f"invalid task.max_length={value!r}: expected an integer >= 2")


def summarization_requests(tokenizer: Any, docs: list[dict], template: str, max_length: int, max_new_tokens: int,
                           chat: bool, dataset: str) -> list[GenRequest]:
    """One request per document record ({id, document, references, title?}); see the module docstring."""
    stops = stop_token_ids(tokenizer)
    out = []
    for doc in docs:
        full = template.format(document=doc["document"], context=doc["document"], title=doc.get("title", ""))
        prompt = truncate_prompt_middle(tokenizer, full, max_length)
        truncated = prompt != full
        if chat:
            prompt = apply_chat(tokenizer, prompt)
        out.append(GenRequest(
            id=str(doc["id"]), dataset=dataset, prompt=prompt, token_ids=encode(tokenizer, prompt, chat),
            max_new_tokens=max_new_tokens, references=list(doc["references"]), stop_ids=stops,
            extra={"truncated": truncated, **({"length": doc["length"]} if "length" in doc else {})},
        ))
    return out


def run_summarization(engine: Any, tokenizer: Any, cfg: Any, progress: Any, requests: list[GenRequest],
                      desc: str) -> TaskResult:
    """Generate for every request and score it with the ROUGE set (per sample in [0, 1], metrics x100)."""
    if not requests:
        raise UserError(f"no documents to summarize for task {desc!r}")
    outputs, perf = run_generation(engine, tokenizer, requests, batch_size=batch_size_of(cfg), progress=progress,
                                   desc=desc)
    samples, scores = [], []
    for out in outputs:
        s = summarization_scores(out.prediction, out.request.references)
        scores.append(s)
        samples.append(out.record(**s))
    metrics = mean_scores(scores)
    metrics["num_documents"] = len(samples)
    metrics["truncated"] = sum(1 for s in samples if s.get("truncated"))
    return TaskResult(metrics=metrics, samples=samples, perf=perf)


@dataclass
class SummarizationOptions:
    name: str = "summarization"
    split: str = "test"
    limit: Optional[int] = 10
    reference: str = "aspects"
    prompt: str = DEFAULT_PROMPT
    max_length: int = 7500
    max_new_tokens: int = 256
    chat_template: Any = "auto"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise UserError(f"invalid task.split={self.split!r}: choices are {', '.join(SPLITS)}")
        if self.reference not in REFERENCE_CHOICES:
            raise UserError(f"invalid task.reference={self.reference!r}: choices are {', '.join(REFERENCE_CHOICES)}")
        check_limit(self.limit)
        check_max_length(self.max_length)
        check_positive("task.max_new_tokens", self.max_new_tokens)
        if "{document}" not in str(self.prompt):
            raise UserError("task.prompt needs a {document} field (and may use {title})")
        try:
            self.prompt.format(document="", context="", title="")
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(f"invalid task.prompt: {exc!r}; fields are {{document}} and {{title}}") from None
        self.chat_template = check_chat_template_option(self.chat_template)


def limited_workload(opts: Any, what: str) -> Optional[Workload]:
    """`limit` documents of at most `max_length` prompt tokens and `max_new_tokens` generated (None: no limit)."""
    if opts.limit is None:
        return None
    return Workload(opts.limit, opts.limit * opts.max_length, opts.limit * opts.max_new_tokens,
                    f"up to {opts.limit} {what}", "task.limit=N, task.max_length=N", exact=False)


@register_task("summarization")
class Summarization(Task):

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)
    Options = SummarizationOptions

    def workload(self, settings: Any) -> Optional[Workload]:
        return limited_workload(self.options, "ACLSum paper(s)")

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        try:
            docs = load_aclsum(opts.split, limit=opts.limit, reference=opts.reference)
        except (ImportError, FileNotFoundError) as exc:
            raise UserError(f"task=summarization needs the aclsum package "
                            f"(pip install --no-deps aclsum==0.1.2): {exc}") from None
        chat = wants_chat_template(opts.chat_template, tokenizer)
        requests = summarization_requests(tokenizer, docs, opts.prompt, opts.max_length, opts.max_new_tokens, chat,
                                          dataset=f"aclsum/{opts.split}")
        return run_summarization(engine, tokenizer, cfg, progress, requests, self.name)
