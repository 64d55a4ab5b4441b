"""What the tests of CRIU's ``--page-workers`` (packaging/criu-patches) share: a patched CRIU
that logs at ``-v4``, the spans of its page writers and drains read from that log, and a
job's processes killed at the end."""

from __future__ import annotations

import re
import signal
from functools import partial
from pathlib import Path

import pytest
from ckpt_helpers import wait_for

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import PAGE_WORKERS_FLAG, Criu, has_page_workers

_TS = r"^\((\d+\.\d+)\)\s+"
#: CRIU's log lines around a task's page writer (patch 0002) and its drain (patch 0006)
START = re.compile(_TS + r"Writing pages of (\d+) in the background")
END = re.compile(_TS + r"Wrote pages of (\d+)$")
DRAIN_START = re.compile(_TS + r"Draining pages of (\d+) in the background")
DRAIN_END = re.compile(_TS + r"Drained pages of (\d+)$")


def patched_criu(criu_bin: str, tmp_path: Path, workers: int) -> Criu:
    """``criu_bin`` with ``workers`` page workers, logging at -v4 into ``tmp_path/logs``;
    a CRIU without the option fails the test (a stale or unpatched install)."""
    if not has_page_workers(criu_bin):
        pytest.fail(f"{criu_bin} has no {PAGE_WORKERS_FLAG}: run scripts/install-criu")
    (tmp_path / "logs").mkdir()
    return Criu(criu_bin, page_workers=workers, log_level=4, log_dir=tmp_path / "logs")


def spans(
    log: Path, start_re: re.Pattern[str] = START, end_re: re.Pattern[str] = END
) -> dict[int, tuple[float, float]]:
    """(start, end) of every task's page writer (or, given the drain's lines, of its drain),
    from CRIU's dump log."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if m := start_re.match(line):
            start[int(m.group(2))] = float(m.group(1))
        elif m := end_re.match(line):
            end[int(m.group(2))] = float(m.group(1))
    assert set(start) == set(end), f"started {sorted(start)}, ended {sorted(end)}"
    return {pid: (start[pid], end[pid]) for pid in start}


def _dead(pid: int) -> bool:
    return not proctree.alive(pid)


async def kill(*pids: int) -> None:
    """SIGKILL each of ``pids``' trees and wait until each is gone."""
    for pid in pids:
        if proctree.alive(pid):
            proctree.signal_all([pid], signal.SIGKILL)
            await wait_for(partial(_dead, pid), "the job to die", 30)
