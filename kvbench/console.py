"""What kvbench prints: its messages, warnings and one-line errors (also kept in the run's kvbench.log), and the
exit path of a plain (argparse) console tool. The bottom layer beside kvbench.errors: it imports no kvbench module,
so the runtime, the store and the commands all print the same way."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator, NoReturn

from kvbench.errors import EXIT_USAGE, UserError

PREFIX = "kvbench: error: "

# kvbench's own lines (messages, warnings, errors, summaries) are printed and also kept in the run's log: the
# CLI's Hydra logging config (conf/config.yaml) sends this logger to the run folder's kvbench.log only.
# It is enabled only while a run executes (kvbench.commands.hydra_task.main), so nothing lands in a finished run's log.
RUN_LOG = logging.getLogger("kvbench.run")
RUN_LOG.disabled = True


def say(message: str, *, stream: Any = None, level: int = logging.INFO) -> None:
    """Print one of kvbench's messages (stderr unless `stream`) and keep it in the run's kvbench.log (when the CLI
    set one up: outside Hydra nothing is logged, so nothing is printed twice). Never fails."""
    print(message, file=stream if stream is not None else sys.stderr, flush=True)
    if RUN_LOG.handlers and not RUN_LOG.disabled:
        try:
            RUN_LOG.log(level, message)
        except Exception:  # the log file cannot be written (a full disk, a removed folder): printed is enough
            pass


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """The text with control characters (an ESC sequence from a user's name or path, CR, BEL) shown as \\xNN,
    so a printed line never acts on the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Hold transformers' own warnings back while kvbench reads a config to check it (a longrope config's
    `original_max_position_embeddings` advice, say): the user sees kvbench's verdict, not the library's notes,
    and the same line whether or not transformers warned once already in this process."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def warn(message: str) -> None:
    """One warning line on stderr (and in the run's kvbench.log)."""
    say("kvbench: warning: " + visible(" ".join(str(message).split())), level=logging.WARNING)


def report(message: str) -> None:
    """Print one error line to stderr."""
    line = visible(" ".join(str(message).split()))  # one line, whatever the message
    say(PREFIX + line, level=logging.ERROR)


def follower_rank() -> bool:
    """Whether this process is a rank other than 0 of a torchrun launch (WORLD_SIZE set, RANK not 0)."""
    return os.environ.get("WORLD_SIZE") is not None and os.environ.get("RANK", "0").strip() not in ("", "0")


def report_bad_input(message: str) -> None:
    """The one line for bad input, printed by one process: every rank of a launch checks the same config, so
    rank 0 says it and the others exit 2 quietly (one line, not one per rank)."""
    if not follower_rank():
        report(message)


def exit_usage(message: str) -> NoReturn:
    """One error line (rank 0 of a launch only: report_bad_input), then exit EXIT_USAGE (bad input)."""
    report_bad_input(message)
    raise SystemExit(EXIT_USAGE)


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Console entry point of a plain (argparse) tool: exit with main()'s code; bad input -> one line, exit 2."""
    try:
        code = main()
    except UserError as exc:
        exit_usage(str(exc))
    sys.exit(code)
