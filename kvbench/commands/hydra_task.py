"""The Hydra task function: one composed config, run by kvbench.run.app.run in whichever process Hydra (or its
launcher) runs the job; bad input and failures become one line and an exit code noted on the exit channel, so a sweep
goes on; only SIGINT/SIGTERM escape.

    python -m kvbench ...    -> kvbench.__main__ -> hydra_task.main(cfg) -> app.run(cfg)
"""
from __future__ import annotations

import errno
import os
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvbench.run import app
from kvbench.console import RUN_LOG, report, report_bad_input
from kvbench.errors import UserError
from kvbench.run.exit_channel import note_exit
from kvbench.run.hydra_folders import discard_unstarted
from kvbench.run.plan import plan_run
from kvbench.reporting.wandb_logger import sweep_group


def main(cfg: DictConfig, **run_kwargs: Any) -> Optional[dict]:
    """The Hydra task function: run one config; only SIGINT/SIGTERM escape, so a sweep goes on.

    run_kwargs go to kvbench.run.app.run (tests pass their fake loader, engine and method builder). SIGTERM is turned
    into Terminated by the caller (kvbench.commands.cli.install_sigterm_handler: `python -m kvbench` and its launcher workers)."""
    run_dir = None
    try:
        if HydraConfig.initialized():
            hydra_cfg = HydraConfig.get()
            run_dir = hydra_cfg.runtime.output_dir
            if hydra_cfg.mode == RunMode.MULTIRUN and "wandb_group" not in run_kwargs:  # one group per sweep
                run_kwargs["wandb_group"] = sweep_group(hydra_cfg.sweep.dir)
    except Exception:  # pragma: no cover
        pass
    if os.environ.get("KVBENCH_CHECK_ONLY") == "1":  # kvbench-torchrun's check before its launch (kvbench.commands.torchrun)
        return _check_only(cfg, run_dir)
    RUN_LOG.disabled = False  # kvbench's lines go to this run's kvbench.log (Hydra's file handler) while it runs
    try:
        return _run_and_note(cfg, run_dir, run_kwargs)
    finally:
        RUN_LOG.disabled = True


def _check_only(cfg: DictConfig, run_dir: Optional[str]) -> None:
    """Check the config as a run does before its model loads, run nothing; bad input: one line, exit code 2."""
    try:
        plan_run(cfg)
    except UserError as exc:
        report_bad_input(str(exc))
        note_exit(2)
    if run_dir is not None:
        discard_unstarted(run_dir)
    return None


def _run_and_note(cfg: DictConfig, run_dir: Optional[str], run_kwargs: dict) -> Optional[dict]:
    try:
        record = app.run(cfg, run_dir=run_dir, **run_kwargs)
    except UserError as exc:
        report_bad_input(str(exc))  # the same on every rank of a launch: rank 0 says it
        note_exit(2)
        if run_dir is not None:
            discard_unstarted(run_dir)
        return None
    except OSError as exc:  # e.g. a full disk before config.yaml, or while even the failure could not be recorded
        where = exc.filename or run_dir or "the results folder"
        report(f"run failed: could not write {where}: {exc.strerror or exc}"
               + (f" ({errno.errorcode[exc.errno]})" if exc.errno in errno.errorcode else ""))
        note_exit(1)
        return None
    except Exception as exc:
        report(f"run failed: {type(exc).__name__}: {exc}")
        note_exit(1)
        return None
    if record.get("status") == "claimed" and not app.in_sweep():
        # one run, asked for while another worker runs it: nothing was run or printed here, so not a success (in a
        # sweep, skipping it is how workers split the sweep; the other worker records it)
        holder = record.get("holder") or {}
        report(f"run {record.get('run_id')} is being run by pid {holder.get('pid')} on {holder.get('host')}: "
               f"not run here; its result will be in {run_dir or 'its run folder'} (run again when it finishes)")
        note_exit(1)
        return record
    folder = record.get("run_dir") if record.get("status") != "claimed" else None
    note_exit(0 if record.get("status") in ("ok", "claimed") else 1, folder)
    return record
