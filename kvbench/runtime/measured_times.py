"""Times the first-use messages quote, as `bench/first_hour.py --write` measured them on a machine, with the date
(measured_times.json next to this file): no time in a message is typed by hand."""
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


def quoted(name: str) -> str:
    """"took 150 s on a 2-CPU machine (measured 2026-12-03)", with the load average when the machine was busier
    than its CPU count; "" when never measured."""
    entry = measured(name)
    if entry is None:
        return ""
    cpus, load = entry.get("cpus"), entry.get("load_avg_1m")
    busy = f" at load {load:.0f}" if isinstance(load, (int, float)) and isinstance(cpus, int) and load > cpus else ""
    return f"took {entry['seconds']:.0f} s on a {cpus or '?'}-CPU machine{busy} (measured {entry.get('date', '?')})"
