"""User-facing errors: bad input is reported as one line and exit code 2, never a traceback.

`UserError` is raised by kvbench code for bad input (unknown choice, invalid value, missing file or dataset).
`run_cli(main)` runs the Hydra entry point and turns both UserError and Hydra's own composition errors
(unknown group option, value of the wrong type, unknown key, malformed override) into one line on stderr:

    kvbench: error: unknown method 'foo': choices are full, h2o, ...

and exit code 2. Hydra reports its errors itself unless HYDRA_FULL_ERROR is set, so run_cli sets it (when the
user has not) to receive them as exceptions; a user who sets HYDRA_FULL_ERROR=1 gets Hydra's full traceback.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import threading
from typing import Any, Callable, NoReturn, Optional

EXIT_USAGE = 2
PREFIX = "kvbench: error: "

# What a value must look like, for the keys where Hydra's own wording would not say it.
VALUE_HINTS = {
    "budget": "a positive integer (KV tokens kept per sequence, layer and kv-head) or null",
    "seed": "an integer >= 0",
    "rerun": "true or false",
}
_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "Bool": "true or false",
               "String": "a string"}


EXIT_TERMINATED = 128 + signal.SIGTERM


class UserError(Exception):
    """Bad input from the user (unknown choice, invalid value, missing file or dataset)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (what a cluster scheduler sends), raised like Ctrl-C so the run is recorded as "terminated"."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def install_sigterm_handler() -> None:
    """Turn SIGTERM into Terminated in this process (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)


def report(message: str) -> None:
    """Print one error line to stderr."""
    line = " ".join(str(message).split())  # one line, whatever the message
    print(PREFIX + line, file=sys.stderr, flush=True)


def exit_usage(message: str) -> NoReturn:
    report(message)
    raise SystemExit(EXIT_USAGE)


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Console entry point of a plain (argparse) tool: exit with main()'s code; bad input -> one line, exit 2."""
    try:
        code = main()
    except UserError as exc:
        exit_usage(str(exc))
    sys.exit(code)


def _choices(options: Any) -> str:
    opts = sorted(str(o) for o in (options or []))
    return ", ".join(opts) if opts else "(none found)"


def describe_hydra_error(ex: BaseException) -> Optional[str]:
    """One line for a Hydra/OmegaConf composition error, or None if ex is not one."""
    try:
        from hydra.errors import HydraException, MissingConfigException, OverrideParseException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError:  # pragma: no cover
        return None

    if isinstance(ex, MissingConfigException):
        missing = getattr(ex, "missing_cfg_file", None) or ""
        if "/" in missing:
            group, _, value = missing.rpartition("/")
            return f"unknown {group} '{value}': choices are {_choices(getattr(ex, 'options', None))}"
        return str(ex).splitlines()[0]
    if isinstance(ex, OverrideParseException):
        detail = (getattr(ex, "message", "") or str(ex)).splitlines()[0]
        return f"cannot parse override '{getattr(ex, 'override', '')}': {detail}"
    cause = ex.__cause__
    if isinstance(ex, HydraException) and isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None) or "?"
        msg = (getattr(cause, "msg", "") or str(cause)).splitlines()[0]
        parent = getattr(cause, "parent_node", None)
        if "not in" in msg or "is not in struct" in msg:  # unknown key
            keys = [str(k) for k in (parent.keys() if parent is not None else []) if str(k) != "hydra"]
            hint = f" (to add a new key use +{key}=...)" if getattr(cause, "object_type_str", "") == "dict" else ""
            return f"unknown option {key}: valid options are {_choices(keys)}{hint}"
        value = getattr(cause, "value", None)
        expected = VALUE_HINTS.get(key)
        if expected is None:
            m = re.search(r"converted to (\w+)", msg)
            expected = _TYPE_WORDS.get(m.group(1), m.group(1)) if m else None
            if "valid bool" in msg:
                expected = "true or false"
        if expected:
            return f"invalid {key}={value!r}: expected {expected}"
        return f"invalid {key}={value!r}: {msg}"
    if isinstance(ex, HydraException):
        return str(ex).splitlines()[0] if str(ex) else type(ex).__name__
    from omegaconf.errors import InterpolationResolutionError

    if isinstance(ex, InterpolationResolutionError):  # e.g. results_dir=${oc.env:UNSET}, met by Hydra itself
        return f"cannot resolve an interpolation: {(getattr(ex, 'msg', '') or str(ex)).splitlines()[0]}"
    return None


def run_cli(main: Callable[[], Any], after: Optional[Callable[[], int]] = None) -> NoReturn:
    """Run a @hydra.main function; bad input -> one line + exit 2. `after()` gives the final exit code."""
    user_wants_traceback = bool(os.environ.get("HYDRA_FULL_ERROR"))
    os.environ["HYDRA_FULL_ERROR"] = "1"
    install_sigterm_handler()
    try:
        main()
    except UserError as ex:
        exit_usage(str(ex))
    except Exception as ex:
        message = None if user_wants_traceback else describe_hydra_error(ex)
        if message is None and isinstance(ex, OSError) and not user_wants_traceback:
            # Hydra could not create the run or sweep folder: the results_dir is unusable
            where = getattr(ex, "filename", None) or "results_dir"
            message = f"cannot write the results folder {where}: {ex.strerror or ex} (check results_dir=...)"
        if message is None:
            raise
        exit_usage(message)
    except Terminated:
        report("terminated")
        raise SystemExit(EXIT_TERMINATED)
    except KeyboardInterrupt:
        report("interrupted")
        raise SystemExit(130)
    raise SystemExit(after() if after is not None else 0)


def run_app_cli(main: Callable[[], Any]) -> NoReturn:
    """run_cli for `python -m kvbench`: the exit code also counts runs done by launcher workers (joblib, submitit)."""
    from kvbench import app

    app.open_exit_channel()
    try:
        run_cli(main, after=app.exit_code)
    finally:
        app.close_exit_channel()
