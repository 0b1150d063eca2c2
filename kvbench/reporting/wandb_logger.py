"""Weights & Biases logging of a run: config, metrics and a samples table. Never fails a run.

- logger.wandb=false (or logger.mode=disabled): nothing is imported or written.
- logger.mode=auto: online when WANDB_API_KEY is set (or WANDB_MODE says otherwise), else offline into the run
  folder (run_dir/wandb/offline-run-*), which `wandb sync` uploads later.
- wandb is imported only when used; if it is missing, or init/log/finish raises, a one-line warning is printed
  and the run goes on.
- Online init is bounded by logger.init_timeout_s (default 30 s); when it fails or times out (no network), the run
  logs offline into the run folder instead, with a warning.
- The offline folders of earlier attempts of the same run (a killed or retried run) are removed when a new attempt
  starts, so `wandb sync <run>/wandb/offline-run-*` uploads only the attempt whose results the folder holds.
- Constants (what was fixed before the run: the config's values, seed, pid, host, versions, the model and storage
  it loaded) go to the W&B run's config; its metrics (`run.log`, the summary) are what the run measured, with its
  status and error.
- Runs of one experiment (the top-level `experiment` key) share a W&B `group`; so do the runs of one Hydra sweep
  (`-m`): sweep_group(the sweep's folder). At the sweep's end the CLI logs one more run to that group (log_sweep,
  job type `sweep`): the sweep's results as a wandb.Table and the report's plots.
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import shutil
from typing import Any, Iterable, Optional

from kvbench.console import say, warn
from kvbench.errors import first_line

MAX_TABLE_ROWS = 1000
# what a record holds about the run's outcome: W&B summary, never config (status and error change at the end)
OUTCOME_KEYS = frozenset({"status", "error", "num_samples"})


def sweep_group(sweep_dir: str) -> str:
    """The W&B group of the runs of a Hydra sweep: its folder's name and a hash of its absolute path (W&B groups are
    at most 128 characters)."""
    path = os.path.abspath(os.path.expanduser(sweep_dir))
    return f"sweep-{os.path.basename(path.rstrip(os.sep))[:80]}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def resolve_mode(mode: str) -> str:
    """online / offline / disabled for a configured mode (auto looks at WANDB_MODE and WANDB_API_KEY)."""
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float, str, bool)) or v is None


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if _scalar(v):
        return v
    import json

    return json.dumps(v, ensure_ascii=False, default=str)


class WandbLogger:
    def __init__(self, settings: Any, *, run_dir: str, run_id: str, config: Optional[dict] = None,
                 tags: Optional[list] = None, job_type: Optional[str] = None, group: Optional[str] = None):
        self.settings = settings
        self.run_dir = run_dir
        self.run_id = run_id
        self.config = config or {}
        self.tags = [str(t) for t in (tags or []) if t is not None]
        self.job_type = job_type
        self.group = group
        self.run: Any = None
        self.mode: Optional[str] = None
        self.constants: dict = {}  # the record's fields fixed before the run measured anything (note_constants)

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.settings, "wandb", False)) and getattr(self.settings, "mode", "auto") != "disabled"

    def start(self) -> None:
        if not self.enabled:
            return
        self.mode = resolve_mode(self.settings.mode)
        if self.mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            warn("wandb is not installed, so this run is not logged to W&B "
                 "(pip install wandb, or logger.wandb=false to silence this)")
            return
        remove_stale_offline_runs(self.run_dir)
        before = set(glob.glob(os.path.join(self.run_dir, "wandb", "run-*")))
        try:
            self.run = self._init(wandb, self.mode)
        except Exception as exc:  # any W&B failure is a warning, never a failure
            self.run = None
            reason = f"{type(exc).__name__}: {first_line(exc, fallback='')}"
            if self.mode != "online":
                warn(f"W&B init failed ({reason}); continuing without W&B")
                return
            warn(f"W&B online init failed or timed out after at most {self._timeout():g} s ({reason}); "
                 f"logging offline into the run folder instead (wandb sync uploads it later)")
            self.mode = "offline"
            for path in set(glob.glob(os.path.join(self.run_dir, "wandb", "run-*"))) - before:
                shutil.rmtree(path, ignore_errors=True)  # the failed online attempt: nothing to sync
            try:
                self.run = self._init(wandb, "offline")
            except Exception as exc2:
                self.run = None
                warn(f"W&B offline init failed too ({type(exc2).__name__}); continuing without W&B")

    def _timeout(self) -> float:
        return float(getattr(self.settings, "init_timeout_s", 30.0) or 30.0)

    def _init(self, wandb: Any, mode: str) -> Any:
        os.makedirs(self.run_dir, exist_ok=True)
        timeout = self._timeout()
        return wandb.init(
            project=self.settings.project, entity=self.settings.entity, name=self.run_id,
            dir=self.run_dir, config=self.config, mode=mode, tags=self.tags or None,
            job_type=self.job_type, group=self.group, reinit="finish_previous",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, init_timeout=timeout,
                                    login_timeout=timeout),
        )

    def note_constants(self, record: dict) -> None:
        """The record's fields so far (but its outcome: OUTCOME_KEYS) are constants of the run: its W&B config,
        beside the resolved config given at init (a key of that config, such as its `task` section or `seed`, keeps
        the config's value: the record's `task` is the section's name)."""
        self.constants.update({k: v for k, v in record.items() if k not in OUTCOME_KEYS and _scalar(v)})
        self._update_config()

    def _update_config(self) -> None:
        if self.run is None:
            return
        try:
            self.run.config.update({k: v for k, v in self.constants.items() if k not in self.config},
                                   allow_val_change=True)
        except Exception as exc:
            warn(f"W&B logging failed ({type(exc).__name__}: {exc}); the results folder is complete anyway")

    def log_result(self, record: dict, samples: Optional[list] = None) -> None:
        """The run's measured figures as metrics (run.log and the summary, with status and error; not its constants,
        which note_constants put in the config); the samples as a table."""
        if self.run is None:
            return
        try:
            import wandb

            scalars = {k: v for k, v in record.items() if _scalar(v) and v is not None and k not in self.constants}
            numeric = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                       and math.isfinite(float(v))}
            if numeric:
                self.run.log(numeric)
            self.run.summary.update(scalars)
            if samples and getattr(self.settings, "log_samples", True):
                rows = samples[:MAX_TABLE_ROWS]
                columns: list[str] = []
                for r in rows:
                    for k in r:
                        if k not in columns:
                            columns.append(k)
                table = wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])
                self.run.log({"samples": table})
        except Exception as exc:
            warn(f"W&B logging failed ({type(exc).__name__}: {exc}); the results folder is complete anyway")

    def finish(self, failed: bool = False) -> None:
        """Close the W&B run; an offline run says where it logged and the command that uploads it."""
        if self.run is None:
            return
        offline_dir = self._offline_dir()
        try:
            self.run.finish(exit_code=1 if failed else 0)
        except Exception as exc:
            warn(f"W&B finish failed ({type(exc).__name__}: {exc})")
            offline_dir = None
        finally:
            self.run = None
        if offline_dir:
            say(f"kvbench: W&B logged offline into {offline_dir}; "
                f"upload it with: wandb sync {offline_dir}")

    def _offline_dir(self) -> Optional[str]:
        """The offline run's folder (run_dir/wandb/offline-run-*), or None for an online run."""
        if self.mode != "offline":
            return None
        try:
            return str(self.run.settings.sync_dir)
        except Exception:
            found = sorted(glob.glob(os.path.join(self.run_dir, "wandb", "offline-run-*")), key=os.path.getmtime)
            return found[-1] if found else None


def remove_stale_offline_runs(run_dir: str) -> int:
    """Delete run_dir/wandb/offline-run-* left by earlier attempts of this run; returns how many."""
    stale = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    latest = os.path.join(run_dir, "wandb", "latest-run")
    if stale and os.path.islink(latest):
        try:
            os.unlink(latest)
        except OSError:
            pass
    return len(stale)


def log_sweep(settings: Any, *, group: str, results_dir: str, records: Iterable[dict],
              plots: Iterable[str] = ()) -> Optional[str]:
    """At a sweep's end: one W&B run in the sweep's group (job type `sweep`) holding its runs' records as a
    wandb.Table `sweep_results` (one row per run, every scalar field) and each plot (a PNG path) as an image under
    `plots/<name>`. Offline runs go into results_dir/wandb. Returns the offline folder (None online or when nothing
    was logged); never raises."""
    logger = WandbLogger(settings, run_dir=results_dir, run_id=f"{group}-results", job_type="sweep", group=group)
    if not logger.enabled:
        return None
    logger.start()
    if logger.run is None:
        return None
    offline_dir = logger._offline_dir()
    try:
        import wandb

        rows = [r for r in records if r]
        columns: list[str] = []
        for r in rows:
            columns += [k for k, v in r.items() if k not in columns and _scalar(v)]
        table = wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows[:MAX_TABLE_ROWS]])
        logged: dict = {"sweep_results": table}
        for path in plots:
            name = os.path.splitext(os.path.basename(path))[0]
            logged[f"plots/{name}"] = wandb.Image(path)
        logger.run.log(logged)
        logger.run.summary.update({"num_runs": len(rows),
                                   "num_ok": sum(1 for r in rows if r.get("status") == "ok")})
    except Exception as exc:
        warn(f"W&B logging of the sweep failed ({type(exc).__name__}: {exc}); its run folders are complete anyway")
    logger.finish()
    return offline_dir
