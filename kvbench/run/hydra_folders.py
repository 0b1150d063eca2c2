"""The folders Hydra makes for a run or a sweep, removed again when kvbench refuses the run before it starts (bad
input): a refusal leaves no empty run folder, multirun.yaml or results folder behind. Only folders this process
made (changed since it started) are removed."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

_STARTED_AT = time.time()  # folders made after this, by this process, are removed again when a refusal empties them


def discard_unstarted(run_dir: str) -> None:
    """Remove the folder Hydra made for a run refused before it started (only Hydra's own files in it), and the
    results folder above it if this process made it and it is now empty."""
    import shutil

    try:
        names = set(os.listdir(run_dir))
        if names <= {".hydra", "kvbench.log"}:
            _close_log_handlers_in(run_dir)  # Hydra's kvbench.log handler would reopen the file in a removed folder
            shutil.rmtree(run_dir, ignore_errors=True)
            _remove_if_new_and_empty(os.path.dirname(os.path.normpath(run_dir)))
    except OSError:
        pass


def discard_sweep_file(sweep_dir: Any) -> None:
    """A sweep refused before its first job: remove the multirun.yaml Hydra saved, and the folder if this process
    made it and it is now empty."""
    try:
        path = os.path.join(str(sweep_dir), "multirun.yaml")
        if os.path.isfile(path) and os.stat(path).st_mtime >= _STARTED_AT - 1:
            os.unlink(path)
        _remove_if_new_and_empty(str(sweep_dir))
    except Exception:  # the refusal itself is what the user must see
        pass


def _remove_if_new_and_empty(folder: str) -> None:
    """Remove `folder` if it is empty and was changed since this process started (Hydra made it for this run)."""
    try:
        if not os.listdir(folder) and os.stat(folder).st_mtime >= _STARTED_AT - 1:
            os.rmdir(folder)
    except OSError:
        pass


def _close_log_handlers_in(folder: str) -> None:
    """Close and detach every logging file handler that writes into `folder`."""
    folder = os.path.realpath(folder)
    for name in [None, *logging.Logger.manager.loggerDict]:
        logger = logging.getLogger(name)
        for handler in list(getattr(logger, "handlers", [])):
            path = getattr(handler, "baseFilename", None)
            if path and os.path.realpath(path).startswith(folder + os.sep):
                logger.removeHandler(handler)
                handler.close()
