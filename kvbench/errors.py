"""kvbench's error types, and the exit codes they end a command with. Nothing else (kvbench.commands.cli turns them into
one line and an exit code; kvbench.console prints the lines)."""
from __future__ import annotations

import signal

EXIT_USAGE = 2  # bad input: one line on stderr, no traceback
EXIT_TERMINATED = 128 + signal.SIGTERM


class UserError(Exception):
    """Bad input from the user (unknown choice, invalid value, missing file or dataset): exit EXIT_USAGE."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what a cluster scheduler sends), raised like Ctrl-C so the run is recorded as "terminated"."""


def first_line(message: object, fallback: str | None = None) -> str:
    """The first line of a message (an exception or its text), stripped: what a one-line error quotes.

    When the message is empty: `fallback` if given, else the exception's type name (or "" for plain text)."""
    lines = str(message).strip().splitlines()
    if lines:
        return lines[0].strip()
    if fallback is not None:
        return fallback
    return type(message).__name__ if isinstance(message, BaseException) else ""
