"""Times the first-use messages quote, as `bench/first_hour.py --write` measured them on a machine, with the date
(measured_times.json next to this file): no time in a message is typed by hand. A figure measured more than once
keeps its runs (`runs`: seconds, date, cpus, load_avg_1m each) and is quoted as the range of the quietest and the
busiest run, each with its load: a time depends on how busy the machine was."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

MEASURED = Path(__file__).with_name("measured_times.json")


def measured(name: str) -> Optional[dict]:
    """{seconds, date, cpus, ...} of figure `name` (convert, compile), or None when never measured."""
    try:
        entry = json.loads(MEASURED.read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and isinstance(entry.get("seconds"), (int, float)) else None


def _runs(entry: dict) -> list[dict]:
    runs = [r for r in entry.get("runs", []) if isinstance(r, dict) and isinstance(r.get("seconds"), (int, float))]
    return runs or [entry]


def _load(run: dict) -> float:
    load = run.get("load_avg_1m")
    return float(load) if isinstance(load, (int, float)) else 0.0


def quoted(name: str) -> str:
    """"took 150 s on a 2-CPU machine (measured 2026-12-03)", with the load average when the machine was busier
    than its CPU count; "" when never measured."""
    entry = measured(name)
    if entry is None:
        return ""
    runs = sorted(_runs(entry), key=_load)
    if len(runs) > 1 and _load(runs[0]) != _load(runs[-1]):
        quiet, busy = runs[0], runs[-1]
        dates = sorted({str(r.get("date", "?")) for r in (quiet, busy)})
        return (f"took {quiet['seconds']:.0f} s at load {_load(quiet):.1f} to {busy['seconds']:.0f} s at load "
                f"{_load(busy):.0f} on a {quiet.get('cpus') or '?'}-CPU machine (measured {', '.join(dates)})")
    cpus, load = entry.get("cpus"), entry.get("load_avg_1m")
    busy = f" at load {load:.0f}" if isinstance(load, (int, float)) and isinstance(cpus, int) and load > cpus else ""
    return f"took {entry['seconds']:.0f} s on a {cpus or '?'}-CPU machine{busy} (measured {entry.get('date', '?')})"
