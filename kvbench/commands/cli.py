"""The command line's front door: `python -m kvbench` (run_app_cli) and any @hydra.main entry point (run_cli).

Bad input is reported as one line and exit code 2, never a traceback. `run_cli(main)` runs the Hydra entry point
and turns both UserError and Hydra's own composition errors (unknown group option, value of the wrong type,
unknown key, malformed override) into one line on stderr:

    kvbench: error: unknown method 'foo': choices are full, h2o, ...

and exit code 2. Hydra reports its errors itself unless HYDRA_FULL_ERROR is set, so run_cli sets it (when the
user has not) to receive them as exceptions; a user who sets HYDRA_FULL_ERROR=1 gets Hydra's full traceback.
SIGTERM is turned into Terminated (the run is recorded, exit 143); Ctrl-C exits 130.
"""
from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Iterator, NoReturn, Optional

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from kvbench.run.app import announce_sweep
from kvbench.run.config import bool_keys, int_keys
from kvbench.console import PREFIX, exit_usage, report
from kvbench.errors import EXIT_TERMINATED, EXIT_USAGE, Terminated, UserError, first_line
from kvbench.run.exit_channel import close_exit_channel, open_exit_channel
from kvbench.run.hydra_folders import discard_sweep_file
from kvbench.run.plan import plan_run
from kvbench.registry import METHODS
from kvbench.run.spec import check_bool_spellings, integral_spellings
from kvbench.run.sweep_table import end_of_cli, stopped_sweep_table

# What a value must look like, for the keys where Hydra's own wording would not say it.
VALUE_HINTS = {
    "budget": "a positive integer (KV tokens kept per sequence, layer and kv-head) or null",
    "seed": "an integer >= 0",
    "rerun": "true or false",
}
_TYPE_WORDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "Bool": "true or false",
               "String": "a string"}


_terminating = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """The first SIGTERM raises Terminated (the run is recorded, the process exits 143). Another one while that
    is under way (a scheduler or a user repeating it) ends the process at once, with one line, not a traceback
    from wherever the cleanup happened to be (as kill -9 would: the results store holds under that)."""
    global _terminating
    if _terminating:
        try:
            os.write(2, f"{PREFIX}terminated again: exiting now\n".encode())
        finally:
            os._exit(EXIT_TERMINATED)
    _terminating = True
    raise Terminated()


def install_sigterm_handler() -> None:
    """Turn SIGTERM into Terminated in this process (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _choices(options: Any) -> str:
    opts = sorted(str(o) for o in (options or []))
    return ", ".join(opts) if opts else "(none found)"


def describe_hydra_error(ex: BaseException) -> Optional[str]:
    """One line for a Hydra/OmegaConf composition error, or None if ex is not one."""
    user_error = _user_error_in(ex)  # kvbench's own refusal, raised inside a resolver (results_dir='')
    if user_error is not None:
        return str(user_error)
    head = first_line(ex, fallback="")
    m = re.match(r"Could not override '([\w./-]+)'\. No match in the defaults list", head)
    if m:  # a group the config does not select by default (experiment=...): it is added with +
        plus = re.search(r"use (\+\S+)", str(ex))
        return (f"{m.group(1)} is not in the default config, so it is added with a +: "
                f"{plus.group(1) if plus else '+' + m.group(1) + '=...'}")
    if isinstance(ex, MissingConfigException):
        missing = getattr(ex, "missing_cfg_file", None) or ""
        if "/" in missing:
            group, _, value = missing.rpartition("/")
            return (missing_method_yaml(value) if group == "method" else None) or \
                f"unknown {group} '{value}': choices are {_choices(getattr(ex, 'options', None))}"
        return first_line(ex)
    if isinstance(ex, OverrideParseException):
        detail = first_line(getattr(ex, "message", "") or ex)
        return f"cannot parse override '{getattr(ex, 'override', '')}': {detail}"
    cause = ex.__cause__
    if isinstance(ex, HydraException) and isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or getattr(cause, "key", None) or "?"
        msg = first_line(getattr(cause, "msg", "") or cause)
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
        return first_line(ex)
    if isinstance(ex, InterpolationResolutionError):  # e.g. results_dir=${oc.env:UNSET}, met by Hydra itself
        return f"cannot resolve an interpolation: {first_line(getattr(ex, 'msg', '') or ex)}"
    return None


CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "conf")


def missing_method_yaml(name: str) -> Optional[str]:
    """One line for `method=<name>` where a method is registered under that name (its file exists) but
    conf/method/<name>.yaml does not: the YAML to create. None for a name no file registers."""
    try:
        if name not in METHODS:
            return None
        where = METHODS.source_file(name)
    except UserError:  # a clash or a broken file: the registry says so when the method is built
        return None
    path = os.path.relpath(os.path.join(CONF_DIR, "method", f"{name}.yaml"))
    return (f"method {name!r} (registered in {where}) has no YAML: create {path} holding `name: {name}` (its "
            f"options and their defaults are the dataclass's; list those you want to show)")


# errno values of a results folder the user pointed at that cannot be used (bad input: exit 2); any other OSError
# (a full disk, a quota, an I/O error) is a fault of the machine (exit 1).
_UNUSABLE_FOLDER = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR, errno.ENOENT,
                    errno.EEXIST, errno.ENAMETOOLONG, errno.ELOOP}


def _raised_from(ex: BaseException, kind: type) -> Any:
    """The exception of type `kind` that ex is or was raised from (through __cause__ / __context__), or None."""
    seen = set()
    while ex is not None and id(ex) not in seen:
        if isinstance(ex, kind):
            return ex
        seen.add(id(ex))
        ex = ex.__cause__ or ex.__context__
    return None


def os_error_in(ex: BaseException) -> Optional[OSError]:
    """The OSError ex is or was raised from (Hydra wraps its logging setup's in a ValueError), or None."""
    return _raised_from(ex, OSError)


def _user_error_in(ex: BaseException) -> Optional[UserError]:
    """The UserError that ex was raised from (Hydra and OmegaConf wrap a resolver's), or None."""
    return _raised_from(ex, UserError)


def _file_being_written(ex: BaseException) -> Optional[str]:
    """The name of the file an OSError without a file name came from (a write or close that failed: a full disk),
    found as the innermost open file object in its traceback's frames; None if there is none."""
    tb, frames = ex.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase) and isinstance(getattr(value, "name", None), str):
                return value.name
    return None


def describe_os_error(ex: OSError) -> tuple[str, int]:
    """(one line naming the path and the OS error, exit code): 2 for a folder that cannot be used (read-only, not
    a folder, no permission), 1 for a fault such as a full disk."""
    where = ex.filename or _file_being_written(ex) or "the results folder"
    reason = ex.strerror or str(ex)
    if ex.errno in _UNUSABLE_FOLDER:
        return f"cannot write {where}: {reason} (the results folder cannot be used: choose another with results_dir=...)", EXIT_USAGE
    name = errno.errorcode.get(ex.errno, "") if ex.errno else ""
    return f"could not write {where}: {reason}" + (f" ({name})" if name else ""), 1


def run_cli(main: Callable[[], Any], after: Optional[Callable[[], int]] = None,
            stopped: Optional[Callable[[], None]] = None) -> NoReturn:
    """Run a @hydra.main function; bad input -> one line + exit 2. `after()` gives the final exit code;
    `stopped()` runs after SIGINT/SIGTERM (a sweep prints what finished)."""
    user_wants_traceback = bool(os.environ.get("HYDRA_FULL_ERROR"))
    logging.raiseExceptions = False  # a log write that fails (a full disk) must not print a traceback
    os.environ["HYDRA_FULL_ERROR"] = "1"
    install_sigterm_handler()
    try:
        main()
    except UserError as ex:
        exit_usage(str(ex))
    except Exception as ex:
        message = None if user_wants_traceback else describe_hydra_error(ex)
        os_error = None if message is not None or user_wants_traceback else os_error_in(ex)
        if os_error is not None:  # Hydra could not create a run folder or open its kvbench.log
            message, code = describe_os_error(os_error)
            report(message)
            raise SystemExit(code)
        if message is None:
            raise
        exit_usage(message)
    except Terminated:
        report("terminated")
        _after_stop(stopped)
        raise SystemExit(EXIT_TERMINATED)
    except KeyboardInterrupt:
        report("interrupted")
        _after_stop(stopped)
        raise SystemExit(130)
    raise SystemExit(after() if after is not None else 0)


def _after_stop(stopped: Optional[Callable[[], None]]) -> None:
    """Run `stopped()`; a second signal or an error there ends it quietly (the run is already recorded)."""
    if stopped is None:
        return
    try:
        stopped()
    except (Exception, KeyboardInterrupt, Terminated):
        pass


MULTIRUN_FLAGS = ("-m", "--multirun")


def multirun_flag_first(argv: list) -> list:
    """argv with `-m` / `--multirun` moved before the overrides (`kvbench method=h2o -m budget=64,128` would
    otherwise get Hydra's usage text): Hydra reads its flags only before the first override."""
    flags = [a for a in argv[1:] if a in MULTIRUN_FLAGS]
    if not flags:
        return list(argv)
    return [argv[0], flags[0], *[a for a in argv[1:] if a not in MULTIRUN_FLAGS]]


def check_config(cfg: Any) -> Any:
    """Every check a run makes before it loads the model (plan_run), for a config a sweep will run (its Hydra
    node removed, as Hydra removes it before the job starts); UserError on bad input. Returns the RunPlan."""
    from omegaconf import open_dict, read_write

    cfg = cfg.copy()
    with read_write(cfg), open_dict(cfg):
        cfg.pop("hydra", None)
    return plan_run(cfg)


def announce_sweep_once(plans: list) -> None:
    """The sweep's estimate line (kvbench.run.app.announce_sweep: the sum of its jobs), before its first job; a
    failure to estimate never stops the sweep."""
    try:
        announce_sweep(plans)
    except Exception:  # pragma: no cover  (the estimate is a courtesy)
        pass


@contextlib.contextmanager
def every_sweep_job_checked() -> Iterator[None]:
    """While it is open, a sweep (-m) checks every job's config as a run would before it loads the model
    (check_config: values, paths, lengths against the model's positions, ...) before the first job starts,
    after every job composed (Hydra's own check, made here: each job composed once for both); a refused sweep
    leaves no multirun.yaml (and no results folder it made) behind."""
    from hydra.plugins.sweeper import Sweeper

    hydra_check = Sweeper.validate_batch_is_legal

    def check_batch(self: Any, batch: Any) -> None:
        try:
            # Hydra's own check (Sweeper.validate_batch_is_legal) is that every job composes; the jobs composed
            # here for their plans make it, in its order (every job composed before any is planned), each job
            # composed once instead of twice
            loader = getattr(self, "hydra_context", None)
            loader = loader.config_loader if loader is not None else self.config_loader
            configs = [loader.load_sweep_config(master_config=self.config, sweep_overrides=list(o)) for o in batch]
            plans = [check_config(cfg) for cfg in configs]
        except BaseException:
            discard_sweep_file(self.config.hydra.sweep.dir)
            raise
        if os.environ.get("KVBENCH_CHECK_ONLY") != "1":
            announce_sweep_once(plans)

    Sweeper.validate_batch_is_legal = check_batch
    try:
        yield
    finally:
        Sweeper.validate_batch_is_legal = hydra_check


# Command-line arguments that can make a config set hydra.mode: the override itself, or configs from elsewhere
MODE_SOURCES = ("hydra.mode", "--config-path", "--config-name", "--config-dir", "-cp", "-cn", "-cd")


@contextlib.contextmanager
def mode_from_the_flags(argv: list) -> Iterator[None]:
    """While it is open, Hydra takes the run mode from the command line's flags (-m: a sweep, else one run) without
    first composing the whole config only to read `hydra.mode` from it (Hydra.get_mode), then composing it again for
    the run: one compose less per command. The probe finds no mode in kvbench's configs (conf/ never sets
    hydra.mode: tests/app/test_cli.py checks it), and where it finds none Hydra goes by the flags, as here; a command
    line naming hydra.mode or another config (--config-dir, ...) keeps Hydra's probe."""
    from hydra._internal.hydra import Hydra

    if any(a.startswith(MODE_SOURCES) or "hydra.mode" in a for a in argv[1:]) or not hasattr(Hydra, "get_mode"):
        yield  # (a Hydra without the probe: nothing to skip)
        return
    probe = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = probe  # type: ignore[method-assign]


# Hydra overrides for ranks other than 0 of a torchrun launch: rank 0 alone writes into the run folder (no second
# .hydra/ copy, no second writer of kvbench.log)
FOLLOWER_RANK_OVERRIDES = ("hydra.output_subdir=null", f"hydra.job_logging.handlers.file.filename={os.devnull}")


def launch_rank_overrides(argv: list) -> list:
    """argv, with FOLLOWER_RANK_OVERRIDES added on a torchrun rank other than 0 (RANK set and not 0)."""
    rank = os.environ.get("RANK", "0").strip()
    if os.environ.get("WORLD_SIZE") is None or rank in ("", "0"):
        return list(argv)
    return [*argv, *FOLLOWER_RANK_OVERRIDES]


def run_app_cli(main: Callable[[], Any]) -> NoReturn:
    """run_cli for `python -m kvbench`: the exit code also counts runs done by launcher workers (joblib, submitit);
    a sweep's jobs are all checked before the first starts."""
    sys.argv[:] = multirun_flag_first(sys.argv)
    try:
        check_bool_spellings(sys.argv[1:], bool_keys())
        sys.argv[1:] = integral_spellings(sys.argv[1:], int_keys())  # budget=1e12, block_size=16.0: integers
    except UserError as ex:
        exit_usage(str(ex))
    sys.argv[:] = launch_rank_overrides(sys.argv)
    open_exit_channel()
    try:
        with every_sweep_job_checked(), mode_from_the_flags(sys.argv):
            run_cli(main, after=end_of_cli, stopped=stopped_sweep_table)
    finally:
        close_exit_channel()
