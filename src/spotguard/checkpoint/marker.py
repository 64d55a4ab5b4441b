"""The freeze marker: ``operation.json`` in a job's directory, the one crash marker.

Why: a freeze locks the job's GPUs and stops its tree; if the process running it is killed
part-way, nothing else knows which processes to bring back. The marker lives exactly as long
as a freeze — taken before anything is touched, told the tree and the GPU processes once the
scan knows them, removed when the job runs again — so :meth:`~spotguard.checkpoint.engine.
Engine.recover` (called by a restarted agent, see :mod:`spotguard.agent.startup`) can finish
the bring-back. It also keeps two freezes of one job apart. This module only reads and writes
the record; the engine decides when.

Format (JSON, written atomically)::

    {"op": "freeze", "mode": "exit", "agent_pid": 812, "agent_start": 1534822,
     "job_pid": 4410, "started": "2025-05-01T12:00:00+00:00", "gpu_pids": [4412],
     "tree": [4410, 4412]}

``agent_start`` is the writer's start time (clock ticks after boot, ``/proc/PID/stat``): with
``agent_pid`` the writer's identity, so a marker whose writer died and whose pid was given to
another process is recognised as stale, not as a freeze still in progress.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotguard.errors import JobError

from .jobs import JobInfo
from .procfacts import same_process, start_time

MARKER = "operation.json"


def _ints(value: Any, default: list[int]) -> list[int]:
    return [int(p) for p in value] if isinstance(value, list) else default


@dataclass(frozen=True)
class MarkerRecord:
    """What one freeze in progress left in the job's directory."""

    mode: str
    agent_pid: int | None
    job_pid: int
    started: str
    gpu_pids: list[int] = field(default_factory=list)
    tree: list[int] = field(default_factory=list)
    op: str = "freeze"
    agent_start: int | None = None  # the writer's start time (its identity with the pid)

    @classmethod
    def from_json(cls, data: dict[str, Any], job: JobInfo) -> MarkerRecord:
        """Lenient: a field a marker lacks takes the value a bring-back can still use."""
        agent = data.get("agent_pid")
        agent_start = data.get("agent_start")
        return cls(
            mode=str(data.get("mode", "resume")),
            agent_pid=agent if isinstance(agent, int) else None,
            job_pid=int(data.get("job_pid", job.pid)),
            started=str(data.get("started", "")),
            gpu_pids=_ints(data.get("gpu_pids"), []),
            tree=_ints(data.get("tree"), [job.pid]),
            op=str(data.get("op", "freeze")),
            agent_start=agent_start if isinstance(agent_start, int) else None,
        )

    def running_elsewhere(self) -> int | None:
        """The pid of another live process that wrote this marker (its freeze still runs)."""
        other = self.agent_pid
        if other is None or other == os.getpid():
            return None
        return other if same_process(other, self.agent_start) else None


class FreezeMarker:
    """The marker of one job (``<job dir>/operation.json``)."""

    def __init__(self, job: JobInfo) -> None:
        self.job = job
        self.path: Path = job.dir / MARKER

    def take(self, mode: str) -> None:
        """Claim the job for a freeze; :class:`JobError` if another live process holds it."""
        current = self.read()
        other = current.running_elsewhere() if current is not None else None
        if other is not None:
            raise JobError(f"job {self.job.name!r}: another freeze is in progress (pid {other})")
        self._write(
            MarkerRecord(
                mode=mode,
                agent_pid=os.getpid(),
                job_pid=self.job.pid,
                started=datetime.now(UTC).isoformat(),
                gpu_pids=[],
                tree=[self.job.pid],
                agent_start=start_time("self"),
            )
        )

    def update(self, *, gpu_pids: list[int], tree: list[int]) -> None:
        """Record the processes a bring-back must reach (known once the scan ran)."""
        current = self.read() or MarkerRecord.from_json({}, self.job)
        self._write(replace(current, gpu_pids=gpu_pids, tree=tree))

    def read(self) -> MarkerRecord | None:
        """The record, or None when there is none (or it cannot be read)."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return MarkerRecord.from_json(data, self.job) if isinstance(data, dict) else None

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def _write(self, record: MarkerRecord) -> None:
        tmp = self.job.dir / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, self.path)
