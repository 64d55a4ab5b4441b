"""How the demo shows what happens: live on a terminal, one line per event elsewhere (CI).

:class:`LiveUi` keeps a spinner with what the demo waits for (and the bytes reaching the store)
under the lines of what already happened; :class:`LineUi` prints each event as one plain,
timestamped line and progress at most once a second. Both end with :func:`render_report`.
"""

from __future__ import annotations

import io
import shutil
import time
from typing import IO, Protocol

from rich import box
from rich.console import Console
from rich.status import Status
from rich.table import Table

from spotguard.demo.report import DemoReport


class Ui(Protocol):
    """What the scenario tells the person watching."""

    def event(self, text: str) -> None:
        """Something happened (one line that stays)."""

    def waiting(self, text: str) -> None:
        """What the demo waits for now."""

    def progress(self, text: str) -> None:
        """A running figure (bytes streamed); may be shown or dropped."""

    def close(self) -> None:
        """Stop any live display."""


class LineUi:
    """Plain lines for logs and CI: ``[  3.21s] text``."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self._last_wait = ""
        self._last_progress = 0.0

    def _line(self, mark: str, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.2f}s] {mark} {text}", file=self.out, flush=True)

    def event(self, text: str) -> None:
        self._line("+", text)

    def waiting(self, text: str) -> None:
        if text != self._last_wait:
            self._last_wait = text
            self._line(".", text)

    def progress(self, text: str) -> None:
        now = time.monotonic()
        if now - self._last_progress >= 1.0:
            self._last_progress = now
            self._line("~", text)

    def close(self) -> None:
        self.out.flush()


class LiveUi:
    """A rich spinner for the current wait, with finished events printed above it."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.t0 = time.monotonic()
        self._status: Status = console.status("starting", spinner="dots")
        self._status.start()
        self._wait = "starting"

    def event(self, text: str) -> None:
        self.console.print(
            f"[dim]{time.monotonic() - self.t0:6.2f}s[/dim] [green]✓[/green] {text}",
            highlight=False,
        )

    def waiting(self, text: str) -> None:
        self._wait = text
        self._status.update(text)

    def progress(self, text: str) -> None:
        self._status.update(f"{self._wait} — {text}")

    def close(self) -> None:
        self._status.stop()


def make_ui(out: IO[str], *, live: bool) -> Ui:
    """:class:`LiveUi` on a terminal (when ``live``), else :class:`LineUi`."""
    if live and out.isatty():
        return LiveUi(Console(file=out))
    return LineUi(out)


def _seconds(v: float | None) -> str:
    return "—" if v is None else f"{v:+.2f}"


def render_report(report: DemoReport, out: IO[str]) -> None:
    """The timeline table, then the proof (or the one reason it failed); no line ends in
    spaces (rich pads a table's cells to its width)."""
    tty = out.isatty()
    buf = io.StringIO()
    width = shutil.get_terminal_size().columns if tty else 120
    console = Console(file=buf, highlight=False, width=width, force_terminal=tty)
    _render(report, console)
    out.write("".join(line.rstrip() + "\n" for line in buf.getvalue().splitlines()))
    out.flush()


def _render(report: DemoReport, console: Console) -> None:
    if report.timeline:
        table = Table(
            title="timeline (seconds since the notice)",
            box=box.SIMPLE_HEAD,
            title_justify="left",
        )
        table.add_column("step")
        table.add_column("at", justify="right")
        table.add_column("detail")
        for row in report.timeline:
            table.add_row(row.step, _seconds(row.at), row.detail)
        console.print(table)
        console.print(
            "[dim]times: controller job history (agent reports); sizes: image manifest; "
            "freeze window: VM 1 agent log[/dim]"
        )
    if report.ok:
        console.print(f"[bold green]PROOF[/bold green] {report.proof}", soft_wrap=True)
        console.print(f"demo passed in {report.seconds:.1f} s")
    else:
        console.print(
            f"[bold red]demo FAILED[/bold red] at {report.failed_step}: {report.reason}",
            soft_wrap=True,
        )
    if report.kept and report.workdir:
        console.print(f"work dir kept for inspection: {report.workdir}", soft_wrap=True)
