"""`task=govreport`: GovReport summarization, from LongBench's gov_report or the full ccdv/govreport-summarization.

`source`:
- longbench  LongBench's gov_report (200 reports; `data_dir` = a folder of `<dataset>.jsonl` or the official
             data.zip, null = the hub THUDM/LongBench)
- ccdv       the full ccdv/govreport-summarization `split` (973 test reports; `data_dir` = a local copy in the hub's
             layout, parquet or jsonl with columns report and summary; null = the hub)

Both use LongBench's gov_report prompt and its generation length (512 new tokens; `max_new_tokens` changes it), the
middle truncation to `max_length` prompt tokens and the chat template (`chat_template`: auto = when the tokenizer
has one); greedy. Scored with `rouge_l` (LongBench's official ROUGE-L, `rouge` package; on source=longbench it is
LongBench's gov_report score) beside rouge-score's `rouge1`, `rouge2`, `rougeL`, `rougeLsum` (F, stemming), each
100 x mean with 2 decimals.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from kvbench.data.govreport import GOVREPORT_SPLITS, check_data_dir as check_govreport_dir, load_govreport_full, load_govreport_longbench
from kvbench.data.hub import check_revision, require_hub
from kvbench.data.longbench import check_data_dir, check_data_rows, prompt_template
from kvbench.errors import UserError
from kvbench.run.spec import check_positive
from kvbench.tasks._generation import check_chat_template_option, wants_chat_template
from kvbench.tasks.base import Task, TaskResult, Workload, register_task
from kvbench.tasks.summarization import check_limit, limited_workload, check_max_length, run_summarization, summarization_requests

SOURCES = ("longbench", "ccdv")


@dataclass
class GovReportOptions:
    name: str = "govreport"
    source: str = "longbench"
    data_dir: Optional[str] = None
    revision: Optional[str] = None  # the hub dataset's branch, tag or commit (null: default branch; kvbench.data.hub)
    split: str = "test"
    limit: Optional[int] = None
    max_length: int = 7500
    max_new_tokens: int = 512
    chat_template: Any = "auto"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise UserError(f"invalid task.source={self.source!r}: choices are {', '.join(SOURCES)}")
        if self.split not in GOVREPORT_SPLITS:
            raise UserError(f"invalid task.split={self.split!r}: choices are {', '.join(GOVREPORT_SPLITS)}")
        if self.source == "longbench" and self.split != "test":
            raise UserError("task.source=longbench has only the test split (task.split=test)")
        check_revision(self.revision, "data_dir", self.data_dir)
        check_limit(self.limit)
        check_max_length(self.max_length)
        check_positive("task.max_new_tokens", self.max_new_tokens)
        self.chat_template = check_chat_template_option(self.chat_template)


@register_task("govreport")
class GovReport(Task):

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)
    Options = GovReportOptions

    def workload(self, settings: Any) -> Optional[Workload]:
        return limited_workload(self.options, "report(s)")

    def preflight(self, settings: Any, model_shape: Any) -> None:
        """Before the model loads: task.data_dir holds the data, or (null) the hub is reachable."""
        opts = self.options
        if opts.data_dir is None:
            require_hub(f"GovReport ({opts.source})", "task.data_dir")
        elif opts.source == "longbench":
            check_data_dir(opts.data_dir, ["gov_report"])
            check_data_rows(opts.data_dir, ["gov_report"], opts.limit)
        else:
            check_govreport_dir(opts.data_dir, opts.split)

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        try:
            if opts.source == "longbench":
                docs = load_govreport_longbench(opts.data_dir, limit=opts.limit, revision=opts.revision)
            else:
                docs = load_govreport_full(opts.split, data_dir=opts.data_dir, limit=opts.limit, revision=opts.revision)
        except FileNotFoundError as exc:
            raise UserError(f"GovReport data not found: {exc}") from None
        chat = wants_chat_template(opts.chat_template, tokenizer)
        requests = summarization_requests(tokenizer, docs, prompt_template("gov_report"), opts.max_length,
                                          opts.max_new_tokens, chat, dataset=docs[0]["source"] if docs else opts.source)
        result = run_summarization(engine, tokenizer, cfg, progress, requests, self.name)
        result.metrics["source"] = opts.source
        return result
