"""Processes a test session left behind: found through a mark in their environment and through
the parent links of this pytest process, so that a session fails (and cleans up) when a job, an
agent or a server it started outlives the tests.

The mark (``SG_TEST_SESSION``, unique per session) is inherited by every process the tests
start with the default environment, including jobs that ``spotguard run`` detaches with
``setsid`` and jobs CRIU restores (their environment is part of the image). A process started
with an explicit ``env=`` and still a descendant of pytest is found through its parent links.
Other sessions running on the same host carry other marks and are never touched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path

MARK = "SG_TEST_SESSION"


def mark_session(environ: MutableMapping[str, str]) -> str:
    """Give this session (and everything it starts) its own mark, replacing an inherited one
    (a pytest run inside a test is a session of its own)."""
    environ[MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return environ[MARK]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _marked(pid: int, mark: bytes) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return mark in env.split(b"\0")


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _scan(environ: Mapping[str, str]) -> list[int]:
    me = os.getpid()
    value = environ.get(MARK)
    mark = f"{MARK}={value}".encode() if value else None
    stats = {pid: st for pid in _pids() if pid != me and (st := _stat(pid)) is not None}
    live = {pid: st for pid, st in stats.items() if st[0] not in ("Z", "X")}
    found = {pid for pid in live if mark is not None and _marked(pid, mark)}
    for pid in live:  # descendants of this process, whatever their environment
        seen, cur = 0, pid
        while cur in stats and seen < 64:
            cur = stats[cur][1]
            seen += 1
            if cur == me:
                found.add(pid)
                break
    return sorted(found)


def find(environ: Mapping[str, str], grace_s: float = 5.0) -> list[int]:
    """Live processes of this session (other than pytest), after ``grace_s`` for those
    already on their way out."""
    deadline = time.monotonic() + grace_s
    left = _scan(environ)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _scan(environ)
    return left


def describe(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        cmd = raw.replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    st = _stat(pid)
    state = f"state {st[0]}, parent {st[1]}" if st else "gone"
    return f"pid {pid} ({state}): {cmd.strip()[:160]}"


def kill(pids: list[int]) -> list[str]:
    """SIGKILL each leftover (a frozen or stopped job too); returns their descriptions."""
    lines = [describe(pid) for pid in pids]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return lines
