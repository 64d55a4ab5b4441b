"""What people see while bytes move: one unit system, one image size, logs above the bar.

* Sizes and rates are binary everywhere (KiB, MiB, GiB; MiB/s), in bars and summaries alike:
  :func:`fmt_bytes`, :func:`fmt_rate`.
* An image's size is its manifest's totals: the bytes of its files and the bytes its distinct
  chunks take in the store (:func:`fmt_image_size`). ``images list``, ``verify`` and ``pull``
  print exactly that; work done (distinct chunks fetched, bytes written) is said apart.
* While a bar is live, log lines go through the bar's console (:func:`route_logs`), so they
  print above it instead of into it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Task
    from rich.text import Text

    from spotguard.image.stats import TransferStats

__all__ = ["fmt_bytes", "fmt_image_size", "fmt_rate", "route_logs", "transfer_bar"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float) -> str:
    """``1536`` → ``1.5 KiB``; binary units, one decimal (bytes as a whole number)."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{int(value)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def fmt_rate(bytes_per_s: float) -> str:
    """Bytes per second in binary units: ``12.3 MiB/s``."""
    return f"{fmt_bytes(bytes_per_s)}/s"


def fmt_image_size(data_bytes: int, stored_bytes: int) -> str:
    """The one way an image's size is printed: ``4.8 MiB → 2.9 MiB stored``."""
    return f"{fmt_bytes(data_bytes)} → {fmt_bytes(stored_bytes)} stored"


class _ConsoleStream:
    """A text stream whose complete lines are printed through a rich console."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self._buf = ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self.console.print(self._buf, markup=False, highlight=False, soft_wrap=True)
            self._buf = ""


@contextmanager
def route_logs(console: Console) -> Iterator[None]:
    """Send every root stream handler's lines through ``console`` for the block's duration
    (a live bar or spinner on that console then stays below them)."""
    stream = _ConsoleStream(console)
    swapped: list[tuple[logging.StreamHandler[Any], Any]] = []
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(
            handler, logging.FileHandler
        ):
            swapped.append((handler, handler.setStream(stream)))
    try:
        yield
    finally:
        stream.flush()
        for handler, old in swapped:
            handler.setStream(old)


def _rate_column() -> Any:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Transfer speed in binary units (rich's own column is decimal)."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else fmt_rate(speed), style="progress.data.speed")

    return RateColumn()


@contextmanager
def transfer_bar(
    label: str, quiet: bool, *, console: Console | None = None
) -> Iterator[Callable[[TransferStats], None] | None]:
    """A progress bar (bytes, rate, ETA; binary units) on an interactive stderr, with log
    lines routed above it; yields the callback to feed, or None when no bar is shown."""
    if quiet or (console is None and not sys.stderr.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    con = console or Console(stderr=True)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        _rate_column(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=con,
        transient=False,
    )
    task = bar.add_task(label, total=None, note="")

    def update(st: TransferStats) -> None:
        note = f"skipped {fmt_bytes(st.bytes_skipped)}" if st.bytes_skipped else ""
        bar.update(task, completed=st.bytes, total=st.total, note=note)

    with bar, route_logs(con):
        yield update
