"""Progress when stderr is not a terminal: periodic lines with done/total and rate, none when disabled."""
from __future__ import annotations

import io

from kvbench.tasks.base import LogProgress, _NoBar, make_progress


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_log_progress_writes_periodic_lines_with_rate():
    out, clock = io.StringIO(), Clock()
    bar = LogProgress(total=40, desc="perplexity", unit="chunks", interval=10, stream=out, clock=clock)
    for _ in range(35):
        clock.t += 1.0
        bar.update(1)
    clock.t += 2.0
    bar.update(5)  # the last 5 chunks at once, less than `interval` after the previous line
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # after 10, 20, 30 s, and the closing line
    assert lines[0] == "kvbench: perplexity: 10/40 chunks (25%), 1 chunks/s, 10 s elapsed"
    assert lines[-1].endswith(", done") and "40/40" in lines[-1]


def test_short_tasks_write_nothing():
    out, clock = io.StringIO(), Clock()
    bar = LogProgress(total=3, desc="x", unit="it", interval=10, stream=out, clock=clock)
    bar.update(3)
    bar.close()
    assert out.getvalue() == ""


def test_factory_picks_log_lines_off_a_terminal_and_nothing_when_disabled():
    assert isinstance(make_progress(True, stream=io.StringIO())(total=3), LogProgress)
    assert isinstance(make_progress(False, stream=io.StringIO())(total=3), _NoBar)


def test_no_duplicate_closing_line():
    out, clock = io.StringIO(), Clock()
    bar = LogProgress(total=2, desc="x", unit="it", interval=1, stream=out, clock=clock)
    clock.t += 1.0
    bar.update(2)  # the line written here already shows 2/2
    bar.close()
    assert len(out.getvalue().splitlines()) == 1
