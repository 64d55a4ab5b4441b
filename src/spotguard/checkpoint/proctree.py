"""Facts about a job's process tree read from /proc: members, namespace pids, open files,
memory. Small synchronous reads (microseconds each); callers on the event loop may call them
directly or push large trees to a thread."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable
from pathlib import Path

import psutil

from spotguard.errors import JobNotFound

#: paths never carried inside an image (devices, kernel files)
_SPECIAL = ("/dev/", "/proc/", "/sys/", "/run/")


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (root first)."""
    try:
        proc = psutil.Process(root)
        kids = proc.children(recursive=True)
    except psutil.NoSuchProcess as exc:
        raise JobNotFound(f"no process {root}") from exc
    return [root, *(k.pid for k in kids)]


def ns_pids(pid: int) -> list[int]:
    """``pid`` in each PID namespace from ours to its own (``NSpid``; one entry per level,
    so its length is the namespace depth); empty if the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return []
    return [pid]


def ns_pid(pid: int) -> int:
    """The pid of ``pid`` inside its own (innermost) PID namespace."""
    found = ns_pids(pid)
    if not found:
        raise JobNotFound(f"no process {pid}")
    return found[-1]


def host_pids_by_ns_pid(root: int) -> dict[int, int]:
    """Map namespace pid → host pid for every process of the tree under ``root``."""
    return {ns_pid(p): p for p in tree(root)}


def rss_bytes(pids: Iterable[int]) -> int:
    """Resident memory of the processes (bytes; vanished processes count 0)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def _fd_flags(pid: int, fd: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        return None
    return None


def writable_files(pids: Iterable[int]) -> set[Path]:
    """Regular files the processes hold open for writing (not deleted, not special files).

    CRIU records each open file's size and refuses to restore when the file on disk differs
    (``File ... has bad size``), so these are the files an image must carry along.
    """
    found: set[Path] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if not target.startswith("/") or target.endswith(" (deleted)"):
                continue
            if target.startswith(_SPECIAL):
                continue
            flags = _fd_flags(pid, fd)
            if flags is None or flags & os.O_ACCMODE == os.O_RDONLY:
                continue
            path = Path(target)
            if path.is_file():
                found.add(path)
    return found


def uses_device(pid: int, prefix: str) -> bool:
    """True if the process has a file descriptor open on a device path starting ``prefix``."""
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd_dir / fd).startswith(prefix):
                return True
        except OSError:
            continue
    return False


def signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each process that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def _state_and_tracer(pid: int, tid: str) -> tuple[str, int] | None:
    """A thread's scheduler state letter and its tracer's pid (0: none); None if it ended."""
    try:
        text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    except OSError:
        return None
    state, tracer = "", 0
    for line in text.splitlines():
        if line.startswith("State:"):
            state = line.split()[1]
        elif line.startswith("TracerPid:"):
            tracer = int(line.split()[1])
            break
    return state, tracer


def tracers(pids: Iterable[int]) -> set[int]:
    """The pids tracing any thread of ``pids`` (a CRIU while it holds them, a debugger)."""
    found: set[int] = set()
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            st = _state_and_tracer(pid, tid)
            if st is not None and st[1]:
                found.add(st[1])
    return found


def wait_seized(pids: Iterable[int], stop: threading.Event, interval: float = 0.002) -> bool:
    """Wait until every thread of every process in ``pids`` has been seen in a ptrace stop
    (CRIU's dump seizes and stops every task before it reads any memory) and is still traced;
    True then, False once ``stop`` is set first or a process is gone. A seized thread runs
    none of its own code again until its tracer lets it go (the parasite CRIU runs in it is
    CRIU's), so a thread seen stopped once stays held while it is traced: only the threads
    not seen yet are read again on each poll. Runs in a worker thread (it sleeps)."""
    todo = list(pids)
    seen: dict[int, set[str]] = {p: set() for p in todo}
    while not stop.is_set():
        pending = False
        for pid in todo:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                return False
            for tid in tids:
                if tid in seen[pid]:
                    continue
                st = _state_and_tracer(pid, tid)
                if st is not None and st[0] == "t" and st[1]:
                    seen[pid].add(tid)
                elif st is not None:
                    pending = True
        if not pending and all(
            (st := _state_and_tracer(pid, tid)) is None or st[1]
            for pid in todo
            for tid in seen[pid]
        ):
            return True
        stop.wait(interval)
    return False
