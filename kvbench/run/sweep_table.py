"""The table a sweep ends with: one row per run this CLI process and its launcher workers finished or skipped
(their folders come through the exit channel, kvbench.run.exit_channel), printed after Hydra returns or after a signal
stopped the sweep. Where the sweep's runs logged to W&B, its end is logged there too (kvbench.reporting.wandb_logger.log_sweep:
the runs' results as a table and the report's plots, in the sweep's group)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from typing import Optional

from omegaconf import OmegaConf

from kvbench.console import say, warn
from kvbench.errors import first_line
from kvbench.run.exit_channel import exit_code, sweep_runs
from kvbench.store.files import read_json
from kvbench.store.folder import CONFIG_FILE, METRICS_FILE
from kvbench.reporting.summary import format_sweep_table
from kvbench.reporting.wandb_logger import log_sweep


def _print_sweep_table(runs: list, heading: Optional[str] = None) -> None:
    """One table of the runs' stored records (metrics.json), after an optional heading line."""
    records = [read_json(os.path.join(d, METRICS_FILE)) for d in runs]
    table = format_sweep_table([r for r in records if r])
    if table:
        if heading:
            say(heading, stream=sys.stdout)
        say(table, stream=sys.stdout)


def end_of_cli() -> int:
    """After Hydra returns in the CLI process: a sweep (-m) ends with one table of its runs (and, where its runs
    logged to W&B, the sweep's W&B run); the exit code."""
    runs = sweep_runs()
    if runs and (len(runs) > 1 or "-m" in sys.argv or "--multirun" in sys.argv):
        _print_sweep_table(runs)
        log_sweep_to_wandb(runs)
    return exit_code()


def log_sweep_to_wandb(runs: list) -> None:
    """For each W&B group the runs logged to (metrics.json's wandb_group; none when W&B was off): one W&B run with
    their records as a table and the plots of the report over their results folder (`kvbench-report` in a process
    of its own: the CLI never imports the report, pandas and matplotlib, to start)."""
    by_group: dict = {}
    for run_dir in runs:
        record = read_json(os.path.join(run_dir, METRICS_FILE))
        if record and record.get("wandb_group"):
            by_group.setdefault(record["wandb_group"], []).append((run_dir, record))
    for group, members in by_group.items():
        first = members[0][0]
        try:
            settings = OmegaConf.load(os.path.join(first, CONFIG_FILE)).logger
        except Exception as exc:  # pragma: no cover  (a config.yaml removed under the sweep)
            warn(f"W&B: the sweep's results were not logged (no logger settings in {first}: {exc})")
            continue
        results_dir = os.path.dirname(os.path.abspath(first))
        with tempfile.TemporaryDirectory(prefix="kvbench-sweep-report-") as out:
            report = subprocess.run([sys.executable, "-m", "kvbench.reporting.report", results_dir, "--out", out],
                                    capture_output=True, text=True, stdin=subprocess.DEVNULL)
            plots = sorted(glob.glob(os.path.join(out, "plots", "*.png")))
            if report.returncode != 0:  # the table is logged anyway
                last = report.stderr.strip().splitlines()[-1:] or [f"exit code {report.returncode}"]
                warn(f"W&B: the sweep's plots were not logged (kvbench-report: {first_line(last[0])})")
            log_sweep(settings, group=group, results_dir=results_dir, records=[r for _, r in members], plots=plots)


def stopped_sweep_table() -> None:
    """After SIGINT/SIGTERM stopped a sweep in the CLI process: the table of the runs that finished before."""
    runs = sweep_runs()
    if runs and ("-m" in sys.argv or "--multirun" in sys.argv):
        _print_sweep_table(runs, f"kvbench: the sweep stopped; the {len(runs)} run(s) that finished before:")
