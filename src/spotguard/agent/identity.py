"""Which process a protected job is: its pid **and** its start time (``/proc/PID/stat`` field
22, clock ticks after boot) on this boot (``/proc/sys/kernel/random/boot_id``).

A pid alone names whatever process has it now: after the job died (or the VM rebooted) an
unrelated process given the old pid would be adopted, checkpointed under the job's name and
killed by an exit checkpoint. So the agent records the identity when it protects a job (in
the worker and the :mod:`ledger <spotguard.agent.ledger>`) and every later look — the
liveness check, the start of a checkpoint, a restarted agent's adoption — compares identity.

How a restarted agent tells the job from a stranger (:func:`of_job`):

0. its ``job.json`` records its root's start time (every job since that field): the same
   start time is the job, another a stranger;
1. its ledger record names the pid with a start time on this boot: the same start time is
   the job; another is a stranger — unless ``job.json`` was written anew since the record
   (the job restored by hand with its old pid), then rule 2 decides;
2. a job with a ``job.json`` (``spotguard run``, a restore): its root process exists before
   ``job.json`` is written, so a process that started after it (by more than
   :data:`JOB_FILE_SLACK_S`) is a stranger;
3. otherwise (a job named by pid, never protected here): the process there now.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JOB_FILE, JobInfo
from spotguard.checkpoint.procfacts import start_time

log = logging.getLogger(__name__)

#: how much later than its ``job.json`` a job's root process may seem to have started
#: (the boot clock and the wall clock are read at slightly different instants)
JOB_FILE_SLACK_S = 2.0


def boot_id() -> str | None:
    """This boot's id (a reboot gives every pid and start time a new meaning)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


class Recorded(Protocol):
    """What the agent last wrote down about a job's process (a ledger record): its pid,
    start time and boot, and when the record was written."""

    @property
    def pid(self) -> int: ...

    @property
    def start(self) -> int | None: ...

    @property
    def boot(self) -> str | None: ...

    @property
    def updated(self) -> float: ...


@dataclass(frozen=True)
class Identity:
    """One process: pid, start time (ticks after boot) and the boot it ran in."""

    pid: int
    start: int
    boot: str | None

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not another one with its pid)."""
        now = read(self.pid)
        return now is not None and now.start == self.start and now.boot == self.boot

    def started_at(self) -> float:
        """When it started, by the wall clock (from the boot clock: ``/proc/uptime``)."""
        return started_at(self.start)


def read(pid: int) -> Identity | None:
    """The identity of the live (not zombie) process ``pid`` now; None when there is none."""
    start = start_time(pid)
    if start is None or not proctree.alive(pid):
        return None
    return Identity(pid, start, boot_id())


def started_at(start: int) -> float:
    """Wall-clock time of a start time in clock ticks after boot."""
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - uptime + start / os.sysconf("SC_CLK_TCK")


def _job_file_mtime(info: JobInfo) -> float | None:
    try:
        return (info.dir / JOB_FILE).stat().st_mtime
    except OSError:
        return None


def of_job(info: JobInfo, record: Recorded | None) -> Identity | None:
    """The identity of ``info``'s process if the process at ``info.pid`` is the job (see the
    module doc); None when the job's process is gone — nothing there, or a stranger given
    its pid (logged)."""
    now = read(info.pid)
    if now is None:
        return None
    if info.start is not None:  # the job file names its root's start: compare that first
        if info.start == now.start:
            return now
        _stranger(info, "another start time than the job file records")
        return None
    written = _job_file_mtime(info)
    if (
        record is not None
        and record.pid == info.pid
        and record.start is not None
        and record.boot == now.boot
    ):
        if record.start == now.start:
            return now
        if written is None or written <= record.updated:
            _stranger(info, "not the process this agent protected")
            return None
    if written is not None and now.started_at() > written + JOB_FILE_SLACK_S:
        _stranger(info, "it started after the job's job.json was written")
        return None
    return now


def _stranger(info: JobInfo, why: str) -> None:
    log.warning(
        "the job's pid belongs to another process now; the job's process is gone",
        extra={"step": "protect", "job": info.name, "pid": info.pid, "reason": why},
    )
