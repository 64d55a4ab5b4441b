"""When is a job idle? All three at once, over a window, never GPU utilisation alone.

A job counts as busy in a sample interval when any of these is over its threshold:

* **GPU**: the highest SM utilisation NVML sampled for any process of the tree;
* **CPU**: CPU seconds used by the whole tree per wall second (percent of one core) — a user
  reading output is idle, a data-prep loop is not;
* **network**: bytes moved by the tree's TCP connections (``TCP_INFO``), new connections in
  full — a model server answering one request a minute is not idle.

:class:`IdleTracker` keeps the time of the last busy interval; a job is idle once
``idle_after`` seconds have passed since then. The decision is pure (a list of samples in,
seconds idle out), so a test can drive it with real processes and short windows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psutil

from spotguard.checkpoint import proctree

from . import gpu, sockets
from .settings import ParkSettings


@dataclass(frozen=True)
class Sample:
    """One reading of a job's tree."""

    at: float  # time.monotonic()
    cpu_seconds: float
    traffic: dict[int, int]
    nvml_us: int  # NVML clock for the next utilisation query


@dataclass(frozen=True)
class Activity:
    """What a job did between two samples."""

    seconds: float
    cpu_percent: float
    gpu_percent: float
    net_bytes: int

    def busy(self, s: ParkSettings) -> str | None:
        """Which signal says busy (``cpu``, ``gpu``, ``network``), or None when idle."""
        if self.gpu_percent > s.idle_gpu_percent:
            return "gpu"
        if self.cpu_percent > s.idle_cpu_percent:
            return "cpu"
        if self.net_bytes > s.idle_bytes:
            return "network"
        return None


def _cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def sample(pids: Sequence[int]) -> Sample:
    """Read the tree's CPU time and TCP counters now."""
    return Sample(
        at=time.monotonic(),
        cpu_seconds=_cpu_seconds(pids),
        traffic=sockets.traffic(pids),
        nvml_us=int(time.time() * 1e6),
    )


def activity(
    before: Sample,
    after: Sample,
    pids: Sequence[int],
    gpu_util: Callable[[Sequence[int], int], float] = gpu.utilisation,
) -> Activity:
    """What the tree did between two samples (GPU utilisation asked of NVML for the gap)."""
    dt = max(after.at - before.at, 1e-6)
    cpu = max(after.cpu_seconds - before.cpu_seconds, 0.0) / dt * 100.0
    return Activity(
        seconds=dt,
        cpu_percent=cpu,
        gpu_percent=gpu_util(pids, before.nvml_us),
        net_bytes=sockets.traffic_between(before.traffic, after.traffic),
    )


@dataclass
class IdleTracker:
    """Seconds a job has been idle, from successive samples of its tree."""

    settings: ParkSettings
    last: Sample | None = None
    busy_at: float = field(default_factory=time.monotonic)
    last_reason: str = "started"
    tree: list[int] = field(default_factory=list)

    def observe(self, root_pid: int) -> Activity | None:
        """Sample the tree under ``root_pid``; returns the activity since the last sample."""
        try:
            self.tree = proctree.tree(root_pid)
        except Exception:  # noqa: BLE001 - a vanished job is simply not sampled
            return None
        now = sample(self.tree)
        prev, self.last = self.last, now
        if prev is None:
            self.busy_at = now.at
            return None
        act = activity(prev, now, self.tree)
        why = act.busy(self.settings)
        if why is not None:
            self.busy_at = now.at
            self.last_reason = why
        return act

    def idle_seconds(self) -> float:
        return 0.0 if self.last is None else self.last.at - self.busy_at

    def is_idle(self) -> bool:
        return self.settings.idle_after > 0 and self.idle_seconds() >= self.settings.idle_after
