"""The progress line: drawn in place on a terminal, never on a pipe or a log file."""

from __future__ import annotations

import io
import time

from onceflow.progress import REDRAW_S, Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_draws_counts_rate_and_phase_then_erases_itself() -> None:
    tty = Terminal()
    with Progress("run payments", total=3, stream=tty) as progress:
        progress.advance(1, rows=20_000)
        progress.phase("committing")
        time.sleep(REDRAW_S * 2.5)
        line = progress.line()
    drawn = tty.getvalue()
    assert "run payments: 1/3 windows · 20,000 rows" in drawn
    assert "committing" in drawn
    assert "rows/s" in line
    # The last thing written blanks the line and returns to its start.
    assert drawn.endswith("\r") and drawn.rstrip("\r").endswith(" ")


def test_own_output_prints_on_a_clean_line() -> None:
    tty, out = Terminal(), io.StringIO()
    with Progress("run payments", total=2, stream=tty) as progress:
        time.sleep(REDRAW_S * 1.5)
        progress.echo("window 1: committed", out=out)
    assert out.getvalue() == "window 1: committed\n"
    assert "\r" in tty.getvalue()


def test_a_count_past_the_estimate_raises_the_total() -> None:
    progress = Progress("run payments", total=1, stream=io.StringIO())
    progress.advance(2)
    assert progress.line().startswith("run payments: 2/2 windows")


def test_nothing_is_drawn_when_stderr_is_not_a_terminal() -> None:
    pipe = io.StringIO()
    with Progress("reconcile payments", total=4, unit="sinks", stream=pipe) as progress:
        progress.advance()
        time.sleep(REDRAW_S * 1.5)
        progress.echo("report", out=io.StringIO())
    assert pipe.getvalue() == ""
