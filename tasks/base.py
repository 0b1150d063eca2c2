"""The Task interface and the registry of tasks by name.

A task is a class with an `Options` dataclass (the keys of conf/task/<name>.yaml) and a `run` method:

    @register_task("my_task")
    class MyTask(Task):
        @dataclass
        class Options:
            name: str = "my_task"
            max_samples: int = 10

        def run(self, engine, tokenizer, cfg, progress) -> TaskResult:
            ...

`run` gets the engine (kvbench.runtime.serving.engine.Engine: score / generate / memory_stats), the model's tokenizer,
the whole run config (cfg.task holds the raw task options, cfg.runtime.batch_size, cfg.seed, ...; the validated
options are self.options) and `progress`, a factory of progress bars: `progress(total, desc, unit)` returns an
object with update(n) and close() (a tqdm bar on a terminal, periodic log lines when stderr is not one).

It returns TaskResult(metrics, samples, perf): metrics are flat task scores (ppl, rouge_l, accuracy, ...);
samples are one dict per evaluated sample (id, dataset, prompt, prediction, references, per-sample metrics);
perf holds prefill_tokens_per_s, decode_tokens_per_s and ttft_s as measured by the task (null when not applicable).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from kvbench.errors import UserError
from kvbench.registry import Registry


@dataclass
class TaskResult:
    metrics: dict
    samples: list = field(default_factory=list)
    perf: dict = field(default_factory=dict)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LogProgress(_NoBar):
    """Progress for a log (stderr not a terminal: CI, nohup, a cluster job): one line every `interval` seconds,

        kvbench: perplexity: 12/40 chunks (30%), 2.1 chunks/s, 6 s elapsed

    and a last line on close if any was written. `clock` is injectable for tests."""

    def __init__(self, total: Optional[int], desc: str, unit: str, interval: float, stream: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.interval = total, desc or "progress", unit, interval
        self.stream, self.clock = stream if stream is not None else sys.stderr, clock
        self.n, self.postfix, self.lines, self.written_n = 0, "", 0, -1
        self.start = self.last = clock()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self.last >= self.interval:
            self.last = now
            self._write(now)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        if self.lines and self.n != self.written_n:  # a last line unless the previous one already said it all
            self._write(self.clock(), done=True)
        self.lines = 0

    def _write(self, now: float, done: bool = False) -> None:
        elapsed = max(now - self.start, 1e-9)
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = f", {self.postfix}" if self.postfix else ""
        end = ", done" if done else ""
        print(f"kvbench: {self.desc}: {count} {self.unit}{pct}, {self.n / elapsed:.3g} {self.unit}/s, "
              f"{elapsed:.0f} s elapsed{extra}{end}", file=self.stream, flush=True)
        self.lines += 1
        self.written_n = self.n


def growing_total(bar: Any) -> Callable[[int], None]:
    """The bar's update, with the total raised to the work done when the work outgrows it (recompute preemption runs
    a preempted prompt again), so the bar never reads over 100% (tqdm and LogProgress both have `total`)."""
    done = [0]

    def update(n: int = 1) -> None:
        done[0] += n
        total = getattr(bar, "total", None)
        if total is not None and done[0] > total:
            try:
                bar.total = done[0]
            except AttributeError:  # pragma: no cover  (a bar without a settable total)
                pass
        bar.update(n)

    return update


Progress = Callable[..., Any]
LOG_INTERVAL_S = 20.0  # seconds between progress lines when stderr is not a terminal ($KVBENCH_PROGRESS_INTERVAL)


def make_progress(enabled: bool = True, *, stream: Any = None) -> Progress:
    """A progress-bar factory: tqdm on stderr when enabled and stderr is a terminal; when it is not (a log file,
    CI), a line every LOG_INTERVAL_S seconds (LogProgress); no-op bars when disabled."""
    out = stream if stream is not None else sys.stderr

    def progress(total: Optional[int] = None, desc: str = "", unit: str = "it") -> Any:
        if not enabled:
            return _NoBar()
        isatty = getattr(out, "isatty", None)
        if not (isatty and isatty()):
            try:
                interval = float(os.environ.get("KVBENCH_PROGRESS_INTERVAL", LOG_INTERVAL_S))
            except ValueError:
                interval = LOG_INTERVAL_S
            return LogProgress(total, desc, unit, interval, stream=out)
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            return _NoBar()
        return tqdm(total=total, desc=desc, unit=unit, file=out, leave=False, dynamic_ncols=True, unit_scale=True)

    return progress


no_progress = make_progress(False)


@dataclass
class Workload:
    """What a run will compute, known before the model loads (for the time estimate printed first).

    prompts: prompts (or documents, or requests); prompt_tokens: tokens prefilled or scored (an upper bound where
    data lengths are unknown); new_tokens: the most tokens generated; what: the work in words; shorten: the
    options that make it smaller."""

    prompts: int
    prompt_tokens: int
    new_tokens: int
    what: str
    shorten: str
    exact: bool = True  # False: prompt_tokens / new_tokens are upper bounds


class Task:
    """Base class of tasks; subclasses define `Options` and `run`."""

    name: ClassVar[str] = "base"
    # whether run() decodes through the engine's scheduler (Engine.generate / serve): what speculative decoding needs
    decodes: ClassVar[bool] = False
    # whether the work is known only once the task has read its data after the model loads (lm_eval: lm-eval builds
    # its requests then); such a task calls `self.announce(workload)` when it knows, and the app prints the estimate
    workload_known_late: ClassVar[bool] = False
    announce: Optional[Callable[["Workload"], None]] = None  # set by the app before run(); None: nothing printed

    @dataclass
    class Options:
        name: str = "base"

    def __init__(self, options: Any):
        self.options = options

    def preflight(self, settings: Any, model_shape: Any = None) -> None:
        """Checks that need no model (data reachable, lengths within the model's positions), run before the
        model loads; raise UserError naming the bad value. `model_shape` may be None when unknown."""

    def run(self, engine: Any, tokenizer: Any, settings: Any, progress: Progress) -> TaskResult:
        """Evaluate; `settings` is the run's validated kvbench.run.config.Settings (seed, runtime, budget, ...)."""
        raise NotImplementedError

    def workload(self, settings: Any) -> Optional[Workload]:
        """What the run will compute, from the options alone (no data, no model), or None when unknown."""
        return None

    def longest_context(self) -> Optional[tuple[int, str]]:
        """An upper bound on the tokens one sequence of this task holds (prompt + generation), from the options
        alone, with the options that set it (a speculative draft budget at or above it compresses nothing); None
        when unknown."""
        return None

    @classmethod
    def make_options(cls, values: dict) -> Any:
        """The validated Options from a dict of option values; UserError names a bad key or value."""
        fields = [f.name for f in dataclasses.fields(cls.Options) if f.init]
        values = dict(values)
        if "name" not in fields:
            values.pop("name", None)
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise UserError(f"unknown option task.{unknown[0]} for task {cls.name!r}: "
                            f"valid options are {', '.join(sorted(fields))}")
        try:
            return cls.Options(**values)
        except (TypeError, ValueError) as exc:
            raise UserError(f"invalid options for task {cls.name!r}: {exc}") from None


# tokens that a chat template and a question may add around a prompt cut to a length (an upper bound's allowance)
PROMPT_TEMPLATE_ALLOWANCE = 256


TASKS: Registry[type[Task]] = Registry("task", base=Task, package="kvbench.tasks")
register_task = TASKS.register
