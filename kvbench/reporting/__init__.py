"""Helpers of `kvbench-report` and `kvbench-compare`: reading results folders (runs.py), per-sample statistics
(stats.py), plots (plots.py) and the Markdown / HTML rendering of a report (render.py)."""
