"""The table a sweep ends with: one row per run this CLI process and its launcher workers finished or skipped
(their folders come through the exit channel, kvbench.exit_channel), printed after Hydra returns or after a signal
stopped the sweep."""
from __future__ import annotations

import os
import sys
from typing import Optional

from kvbench.console import say
from kvbench.exit_channel import exit_code, sweep_runs
from kvbench.store.files import read_json
from kvbench.store.folder import METRICS_FILE
from kvbench.summary import format_sweep_table


def _print_sweep_table(runs: list, heading: Optional[str] = None) -> None:
    """One table of the runs' stored records (metrics.json), after an optional heading line."""
    records = [read_json(os.path.join(d, METRICS_FILE)) for d in runs]
    table = format_sweep_table([r for r in records if r])
    if table:
        if heading:
            say(heading, stream=sys.stdout)
        say(table, stream=sys.stdout)


def end_of_cli() -> int:
    """After Hydra returns in the CLI process: a sweep (-m) ends with one table of its runs; the exit code."""
    runs = sweep_runs()
    if runs and (len(runs) > 1 or "-m" in sys.argv or "--multirun" in sys.argv):
        _print_sweep_table(runs)
    return exit_code()


def stopped_sweep_table() -> None:
    """After SIGINT/SIGTERM stopped a sweep in the CLI process: the table of the runs that finished before."""
    runs = sweep_runs()
    if runs and ("-m" in sys.argv or "--multirun" in sys.argv):
        _print_sweep_table(runs, f"kvbench: the sweep stopped; the {len(runs)} run(s) that finished before:")
