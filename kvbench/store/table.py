"""Run records as a pandas DataFrame, and the columns that group the runs of one experiment.

    from kvbench.store.runs import load_runs
    from kvbench.store.table import group_columns, runs_frame
    df = runs_frame(load_runs("results"))           # one row per run: its metrics.json fields
    df.groupby(group_columns(df), dropna=False)     # one group per experiment (method, quant, budget vary inside)
"""
from __future__ import annotations

from typing import Any, Iterable

import pandas as pd

SETTING_PREFIXES = ("model_", "task_", "runtime_", "method_", "quant_")
COMPRESSION_COLUMNS = ("method", "quant", "budget")


def runs_frame(runs: list[dict], *, config_columns: bool = False) -> pd.DataFrame:
    """One row per run record (kvbench.store.runs.load_runs): the metrics.json fields (every setting that changes a
    result is one of them: `task_max_tokens`, `method_window`, ...). With config_columns=True, also the config as
    `cfg.<dotted key>` columns (the paper block left out), and the run's folder and experiment as read."""
    rows = []
    for run in runs:
        row = dict(run["metrics"])
        if config_columns:
            row.update({f"cfg.{k}": (v if not isinstance(v, (list, dict)) else str(v))
                        for k, v in run["cfg"].items() if not k.startswith("paper.")})
            row["run_dir"], row["experiment"] = run["run_dir"], run["experiment"]
        rows.append(row)
    return pd.DataFrame(rows)


def group_columns(df: Any, exclude: Iterable[str] = COMPRESSION_COLUMNS) -> list[str]:
    """The columns of runs_frame() that describe a run's settings, except `exclude` (by default the compression
    axes: method, quant, budget and their method_* / quant_* options): group or pivot by these and each group is
    one experiment, e.g. `df.groupby(group_columns(df), dropna=False)`."""
    exclude = set(exclude)
    base = ["model", "task", "seed", "experiment", "dtype", "device"]
    cols = [c for c in base if c in df.columns and c not in exclude]
    for c in df.columns:
        if c.startswith(SETTING_PREFIXES) and c not in cols:
            axis = c.split("_", 1)[0]
            if axis in exclude or c in exclude:
                continue
            cols.append(c)
    return cols
