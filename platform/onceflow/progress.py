"""A one-line progress display for long commands on a terminal (`run`, `reconcile`, `validate`).

It redraws one line of stderr in place, about twice a second: what is being done, how much of
it, how fast, how long. It draws only when stderr is a terminal, so logs, pipes and tests see
the commands' plain output unchanged.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

REDRAW_S = 0.5


class Progress:
    """What a long command is doing, redrawn in place on a terminal.

    Use as a context manager; call `phase` when the command moves on, and `advance` as units of
    work (windows, sinks) finish with the rows they took.
    """

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        unit: str = "windows",
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.rows = 0
        self.current = ""
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._draw_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._width = 0

    def phase(self, text: str) -> None:
        """Say what the command is doing now."""
        with self._lock:
            self.current = text

    def advance(self, units: int = 1, rows: int = 0) -> None:
        """Count finished units of work and the rows they took."""
        with self._lock:
            self.done += units
            self.rows += rows
            if self.total is not None and self.done > self.total:
                self.total = self.done

    def line(self) -> str:
        """The status line as it is drawn now."""
        with self._lock:
            elapsed = time.monotonic() - self._started
            parts = [self.label]
            if self.total is not None:
                parts.append(f"{self.done}/{self.total} {self.unit}")
            elif self.done:
                parts.append(f"{self.done} {self.unit}")
            if self.rows:
                rate = self.rows / elapsed if elapsed > 0 else 0.0
                parts.append(f"{self.rows:,} rows, {rate:,.0f} rows/s")
            parts.append(f"{elapsed:,.0f}s")
            if self.current:
                parts.append(self.current)
            return f"{parts[0]}: " + " · ".join(parts[1:])

    def echo(self, text: str, out: TextIO | None = None) -> None:
        """Print a line of the command's own output (stdout) above the progress line."""
        with self._draw_lock:
            self._erase()
            print(text, file=out if out is not None else sys.stdout, flush=True)

    def _erase(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _draw(self) -> None:
        text = self.line()
        with self._draw_lock:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
            self._width = len(text)

    def _loop(self) -> None:
        while not self._stop.wait(REDRAW_S):
            self._draw()

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(
                target=self._loop, name="onceflow-progress", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._draw_lock:
            self._erase()
