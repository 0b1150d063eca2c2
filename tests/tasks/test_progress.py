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


def test_first_use_of_a_gguf_says_it_converts_before_it_does(tmp_path, monkeypatch, capsys):
    """The conversion takes about a minute on the first run: one line says so before it starts, and only then."""
    from kvbench.runtime.model import loading

    said = []

    def fake_convert(src, dest):  # what had been printed when the (slow) conversion started
        said.append(capsys.readouterr().err)
        dest.mkdir(parents=True)

    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_convert_gguf", fake_convert)
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(range(64)))
    out = loading._converted_gguf(str(tmp_path), "m.gguf", None)
    assert len(said) == 1 and f"kvbench: converting m.gguf into {out}" in said[0] and "first use" in said[0]
    from kvbench.runtime.measured_times import quoted

    assert quoted("convert") in said[0]  # the time bench/first_hour.py measured and dated, never a typed one
    loading._converted_gguf(str(tmp_path), "m.gguf", None)
    assert len(said) == 1 and "converting" not in capsys.readouterr().err  # converted once, said once
