"""Where the threads of a checkpoint spend a window of time, without perf.

A sampler thread reads, every ``interval`` seconds, each thread's state and kernel stack from
/proc (``/proc/PID/task/TID/stat`` and ``.../stack``; the stack needs root) for three groups:
CRIU's processes (and the tasks it restores), this process (spotguard: event loop, pipe
readers, compress threads), and the job's tree. At the end each thread's CPU seconds over the
window (user and system, from ``stat``) and its most frequent states and kernel frames are
summarised, heaviest threads first; a thread's busy share is over the time it was seen
(CRIU lives only for its stage).

Why not perf: the GPU machines carry no perf that matches their kernel, and what the
profile has to answer is coarse — which thread is busy for the whole stage (the one that
bounds it), and whether the others wait on a pipe, a page fault or a lock.

    with Stacks(job_pid) as st:
        ...                       # the stage to profile
    print(st.table("criu dump"))
"""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
#: kernel frames that say nothing about what a thread waits for
_GENERIC = ("entry_SYSCALL", "do_syscall", "__x64_sys", "__do_sys", "x64_sys_call",
            "schedule", "__schedule", "do_epoll_wait", "arch_do_signal",
            "exit_to_user_mode", "syscall_exit", "ret_from_fork")  # fmt: skip


@dataclass
class _Thread:
    group: str
    name: str
    cpu0: tuple[int, int]
    cpu1: tuple[int, int] = (0, 0)
    samples: int = 0
    first: float = 0.0
    last: float = 0.0
    states: collections.Counter[str] = field(default_factory=collections.Counter)
    frames: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class _Role:
    threads: int = 0
    cpu: float = 0.0
    samples: int = 0
    frames: collections.Counter[str] = field(default_factory=collections.Counter)


def _stat(path: Path) -> tuple[str, str, int, int] | None:
    """(comm, state, utime ticks, stime ticks) of one task, or None once it is gone."""
    try:
        raw = (path / "stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2 :].split()
    return comm, rest[0], int(rest[11]), int(rest[12])


def _frame(path: Path) -> str:
    """The first kernel frame below the generic syscall/scheduler ones ('' if none)."""
    try:
        lines = (path / "stack").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        name = line.split("] ", 1)[-1].split("+", 1)[0]
        if name and not name.startswith(_GENERIC):
            return name
    return ""


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _tree(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


class Stacks:
    """Sample the threads of this process, its children (CRIU) and the job's tree."""

    def __init__(self, job_pid: int | None = None, interval: float = 0.05) -> None:
        self.job_pid = job_pid
        self.interval = interval
        self.threads: dict[int, _Thread] = {}
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pids(self) -> list[tuple[str, int]]:
        me = os.getpid()
        out = [("spotguard", me)]
        for p in _tree(me)[1:]:
            out.append(("criu", p))
        if self.job_pid is not None:
            out += [("job", p) for p in _tree(self.job_pid)]
        return out

    def _sample(self) -> None:
        own = threading.get_native_id()
        now = time.perf_counter()
        # this process's threads all have comm "python3": Python's own names say their role
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        for group, pid in self._pids():
            for task in Path(f"/proc/{pid}/task").glob("*"):
                tid = int(task.name)
                if tid == own:
                    continue
                st = _stat(task)
                if st is None:
                    continue
                comm, state, ut, stt = st
                t = self.threads.get(tid)
                if t is None:
                    who = f"{comm}/{tid}" if tid == pid else f"{comm}/{pid}.{tid}"  # a thread
                    if group == "spotguard" and tid in names:
                        who = f"{names[tid]}/{tid}"
                    t = self.threads[tid] = _Thread(group, who, (ut, stt))
                    t.first = now
                if group == "spotguard" and tid in names and t.name.startswith(comm):
                    t.name = f"{names[tid]}/{tid}"  # named by Python after it was first seen
                t.cpu1 = (ut, stt)
                t.last = now
                t.samples += 1
                t.states[state] += 1
                if state != "R":
                    t.frames[_frame(task) or state] += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> Stacks:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stacks", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0

    def roles(self, title: str) -> str:
        """A markdown table per role (a thread's name without its numbers: every compress
        thread, every pipe reader, CRIU's tasks together): threads, CPU seconds, the cores
        they kept busy over the window, and their commonest states and waits."""
        agg: dict[tuple[str, str], _Role] = {}
        for t in self.threads.values():
            role = re.sub(r"\d+", "N", t.name.rsplit("/", 1)[0])
            a = agg.setdefault((t.group, role), _Role())
            a.threads += 1
            a.cpu += (t.cpu1[0] - t.cpu0[0] + t.cpu1[1] - t.cpu0[1]) / TICK
            a.frames.update(t.frames)
            a.frames["running"] += t.states["R"]
            a.samples += t.samples
        lines = [
            f"{title} by role: {self.seconds:.2f} s",
            "",
            "| group | role | threads | cpu s | cores busy | states (share of samples) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for (group, role), a in sorted(agg.items(), key=lambda kv: -kv[1].cpu):
            n = max(1, a.samples)
            waits = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in a.frames.most_common(4))
            busy = a.cpu / max(self.seconds, 1e-9)
            lines.append(f"| {group} | {role} | {a.threads} | {a.cpu:.2f} | {busy:.1f} | {waits} |")
        return "\n".join(lines)

    def table(self, title: str, top: int = 14) -> str:
        """A markdown table: the ``top`` threads by CPU seconds over the window."""
        rows = []
        for t in self.threads.values():
            user = (t.cpu1[0] - t.cpu0[0]) / TICK
            system = (t.cpu1[1] - t.cpu0[1]) / TICK
            rows.append((user + system, user, system, t))
        rows.sort(key=lambda r: r[0], reverse=True)
        lines = [
            f"{title}: {self.seconds:.2f} s, {len(self.threads)} threads sampled",
            "",
            "| group | thread | seen s | cpu s | user s | sys s | busy % of seen | "
            "waits (share of samples) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for total, user, system, t in rows[:top]:
            n = max(1, t.samples)
            waits = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in t.frames.most_common(3))
            seen = t.last - t.first + self.interval
            busy = 100 * total / seen
            lines.append(
                f"| {t.group} | {t.name} | {seen:.2f} | {total:.2f} | {user:.2f} | "
                f"{system:.2f} | {busy:.0f} | {waits or '-'} |"
            )
        return "\n".join(lines)
