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
     "tree": [4410, 4412], "record": null}

``op`` (:class:`Op`) is ``freeze`` (an image), ``suspend`` / ``resume`` (park in place: no
image) or ``restore`` (a park's image restored by unpark); for those ``record`` names park's
record of the job, and a restore's ``images`` the image directory it reads. ``mode`` is the
freeze's :class:`~spotguard.modes.Mode` (``exit`` / ``resume``) and ``null`` for every other
``op``. Markers of the previous format are read as they were meant: there ``mode`` held the
op's name for the in-place operations and a restore (``"mode": "suspend"``), read as no mode;
a marker without ``op`` is a freeze's (the format before ``op`` existed).

``agent_start`` is the writer's start time (clock ticks after boot, ``/proc/PID/stat``): with
``agent_pid`` the writer's identity, so a marker whose writer died and whose pid was given to
another process is recognised as stale, not as a freeze still in progress.

A job directory that cannot be written (the state dir full of the job's own output, or
read-only) never aborts a checkpoint here: the marker then goes to :data:`FALLBACK_DIR`
(``/run/spotguard/markers``, root's, in memory; one file per job directory, naming it, so
:func:`fallback_markers` lets a restarted agent find it), and when that cannot be written
either the freeze goes on without one (an error line: a freeze killed midway is then not
brought back by a restarted agent). The image is what matters; the marker is a record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from spotguard import safefs
from spotguard.errors import JobError, UnsafePath
from spotguard.modes import Mode

from .jobs import JobInfo
from .procfacts import same_process, start_time

MARKER = "operation.json"
#: where a marker goes when the job's directory cannot be written (root's, in memory)
FALLBACK_DIR = Path("/run/spotguard/markers")

log = logging.getLogger(__name__)


class Op(StrEnum):
    """What the process holding a marker does to the job (the file's ``op``): what
    :meth:`~spotguard.checkpoint.engine.Engine.recover` finishes or undoes (one rule each,
    :mod:`.recovery`)."""

    FREEZE = "freeze"  # a checkpoint into an image, in a Mode
    SUSPEND = "suspend"  # park in place (no image)
    RESUME = "resume"  # unpark in place
    RESTORE = "restore"  # a park's image restored by unpark


def _ints(value: Any, default: list[int]) -> list[int]:
    return [int(p) for p in value] if isinstance(value, list) else default


def _op(value: Any) -> Op:
    """The file's ``op``; a marker without one (or with one this version does not know)
    is a freeze's: the bring-back every op but a restore gets."""
    return Op(value) if value in Op._value2member_map_ else Op.FREEZE


def _mode(op: Op, value: Any) -> Mode | None:
    """A freeze's mode (``None`` when unreadable: nothing recovers by it); every other op
    has none — the previous format's ``mode`` held their op's name there."""
    if op is not Op.FREEZE or value not in Mode._value2member_map_:
        return None
    return Mode(value)


@dataclass(frozen=True)
class MarkerRecord:
    """What one freeze (or in-place suspend, resume, or a park's restore) in progress left
    in the job's directory."""

    op: Op
    mode: Mode | None  # a freeze's mode; None for every other op
    agent_pid: int | None
    job_pid: int
    started: str
    gpu_pids: list[int] = field(default_factory=list)
    tree: list[int] = field(default_factory=list)
    agent_start: int | None = None  # the writer's start time (its identity with the pid)
    #: in-place operations (``suspend``, ``resume``): the file that records the job as
    #: suspended (park's record) — a suspend is complete once it exists, a resume once it
    #: is gone (see :meth:`~spotguard.checkpoint.engine.Engine.recover`)
    record: str | None = None
    #: a park's restore (``op`` ``restore``): the image directory it reads — CRIU's own
    #: processes mid-restore name it — removed with ``record`` once the restore completed
    images: str | None = None
    #: the job's start time once known (a restore: set with ``job_pid`` when CRIU returned)
    job_start: int | None = None
    #: a restore: CRIU restored the tree (left stopped) but the GPU memory carried beside
    #: CRIU is not all back yet — such a tree must never be brought back, only killed
    pages_pending: bool = False

    @classmethod
    def from_json(cls, data: dict[str, Any], job: JobInfo) -> MarkerRecord:
        """Lenient: a field a marker lacks takes the value a bring-back can still use."""
        agent, agent_start = writer_of(data)
        op = _op(data.get("op"))
        return cls(
            op=op,
            mode=_mode(op, data.get("mode")),
            agent_pid=agent,
            job_pid=int(data.get("job_pid", job.pid)),
            started=str(data.get("started", "")),
            gpu_pids=_ints(data.get("gpu_pids"), []),
            tree=_ints(data.get("tree"), [job.pid]),
            agent_start=agent_start,
            record=str(data["record"]) if isinstance(data.get("record"), str) else None,
            images=str(data["images"]) if isinstance(data.get("images"), str) else None,
            job_start=data["job_start"] if isinstance(data.get("job_start"), int) else None,
            pages_pending=data.get("pages_pending") is True,
        )

    def running_elsewhere(self) -> int | None:
        """The pid of another live process that wrote this marker (its freeze still runs)."""
        other = self.agent_pid
        if other is None or other == os.getpid():
            return None
        return other if same_process(other, self.agent_start) else None


def writer_of(data: object) -> tuple[int | None, int | None]:
    """A marker's writer as its JSON names it: (``agent_pid``, ``agent_start``), each None
    where absent or not an integer. The one reading of those fields: the engine's marker,
    and the warm-up's check of any busy record (:mod:`spotguard.warm`)."""
    if not isinstance(data, dict):
        return None, None
    return _int_field(data, "agent_pid"), _int_field(data, "agent_start")


def _int_field(data: dict[Any, Any], key: str) -> int | None:
    """``data[key]`` where it is an integer (JSON's true and false are not), else None."""
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def writer_alive(data: object) -> bool:
    """Whether the process that wrote a marker (or a busy record) with this JSON still runs:
    its pid with its start time. A record that names no writer has none alive."""
    pid, start = writer_of(data)
    return pid is not None and same_process(pid, start)


def fallback_path(job_dir: Path) -> Path:
    """Where the marker of the job in ``job_dir`` goes when that directory cannot be
    written (named after the directory: two state dirs may hold jobs of one name)."""
    digest = hashlib.sha256(str(os.path.abspath(job_dir)).encode()).hexdigest()[:16]
    return FALLBACK_DIR / f"{job_dir.name}-{digest}.json"


def fallback_markers() -> list[tuple[Path, dict[str, Any]]]:
    """Every marker in :data:`FALLBACK_DIR`: (its job's directory, its record)."""
    out = []
    for path in sorted(FALLBACK_DIR.glob("*.json")) if FALLBACK_DIR.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("dir"), str):
            out.append((Path(data["dir"]), data))
    return out


class FreezeMarker:
    """The marker of one job (``<job dir>/operation.json``, else :func:`fallback_path`)."""

    def __init__(self, job: JobInfo) -> None:
        self.job = job
        self.path: Path = job.dir / MARKER
        self.fallback: Path = fallback_path(job.dir)

    def take(
        self,
        op: Op,
        mode: Mode | None = None,
        *,
        record: Path | None = None,
        images: Path | None = None,
    ) -> None:
        """Claim the job for a freeze in ``mode`` (or, without a mode, an in-place suspend /
        resume with the ``record`` file that says the job is suspended, or a park's restore
        of ``images``); :class:`JobError` if another live process holds it."""
        if (mode is None) == (op is Op.FREEZE):
            raise ValueError(f"a {op} marker takes a mode exactly when it is a freeze's")
        current = self.read()
        other = current.running_elsewhere() if current is not None else None
        if other is not None:
            raise JobError(f"job {self.job.name!r}: another freeze is in progress (pid {other})")
        self._write(
            MarkerRecord(
                agent_pid=os.getpid(),
                job_pid=self.job.pid,
                started=datetime.now(UTC).isoformat(),
                gpu_pids=[],
                tree=[self.job.pid],
                agent_start=start_time("self"),
                op=op,
                mode=mode,
                record=str(record) if record is not None else None,
                images=str(images) if images is not None else None,
            )
        )

    def update(
        self,
        *,
        gpu_pids: list[int],
        tree: list[int],
        job_pid: int | None = None,
        pages_pending: bool = False,
    ) -> None:
        """Record the processes a bring-back must reach (known once the scan ran, or once
        CRIU restored the tree: then ``job_pid``, the restored root, with its start time, and
        whether GPU memory carried beside CRIU is still to come back, ``pages_pending``)."""
        current = self.read() or MarkerRecord.from_json({}, self.job)
        now = replace(current, gpu_pids=gpu_pids, tree=tree, pages_pending=pages_pending)
        if job_pid is not None:
            now = replace(now, job_pid=job_pid, job_start=start_time(job_pid))
        self._write(now)

    def read(self) -> MarkerRecord | None:
        """The record, or None when there is none (or it cannot be read). The fallback
        first: it exists only while the job directory could not be written."""
        for path in (self.fallback, self.path):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                return MarkerRecord.from_json(data, self.job)
        return None

    def clear(self) -> None:
        for path in (self.fallback, self.path):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # a read-only job directory: the marker stays, logged
                log.warning(
                    "cannot remove the freeze marker",
                    extra={"job": self.job.name, "file": str(path), "error": str(exc)},
                )

    def _write(self, record: MarkerRecord) -> None:
        """Write the record atomically into the job directory; where that fails, into the
        fallback; where both fail, log and go on (see the module doc)."""
        data = json.dumps(asdict(record))
        try:
            safefs.write_atomic(self.path, data.encode())
            with contextlib.suppress(OSError):
                self.fallback.unlink(missing_ok=True)
            return
        except OSError as exc:
            first = exc
        body = {**json.loads(data), "job": self.job.name, "dir": str(self.job.dir)}
        try:
            safefs.ensure_private_dir(FALLBACK_DIR)
            safefs.write_file(self.fallback, json.dumps(body).encode())
        except (OSError, UnsafePath) as exc:
            log.error(
                "cannot write the freeze marker anywhere; freezing without one (a freeze "
                "killed midway is then not brought back by a restarted agent)",
                extra={"job": self.job.name, "file": str(self.path), "error": str(exc)},
            )
            return
        log.warning(
            "cannot write the freeze marker in the job's directory; it is kept in memory",
            extra={"job": self.job.name, "file": str(self.fallback), "error": str(first)},
        )
