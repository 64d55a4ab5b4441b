"""Boot restore: a VM launched by the controller carries an assignment ("restore image X of
job J"); the agent restores the job from it once, then protects it.

The assignment file is written by user-data (:meth:`Assignment.user_data`). Progress is kept
in ``{state_dir}/agent/assignments/{key}.json`` (``key`` = job, attempt and image), so that an
agent restarted after a completed restore does not restore again, and one restarted in the
middle of a restore finds out whether the job came back before trying once more. Those
records are a help, not a condition: when they cannot be written (a full disk) the restore
still runs, and whatever fails is reported as RESTORE_FAILED — the agent never dies on it.
A record is a :class:`RestoreProgress` (``state`` one of :class:`RestoreStep`), read and
written only through :class:`RestoreRecords`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from spotguard import safefs
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import RestoreResult
from spotguard.checkpoint.jobs import JOB_FILE, JobInfo, resolve_job
from spotguard.config import not_text
from spotguard.contracts import (
    Assignment,
    GpuInfo,
    InstanceInfo,
    RestoredEvent,
    RestoreFailedEvent,
    RestoringEvent,
    StepInfo,
    WireError,
)
from spotguard.errors import ConfigError, SpotguardError

from .reporter import Reporter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """The job an assignment brought back (to be protected from now on)."""

    job: str
    pid: int
    image_url: str


def read_assignment(path: Path) -> Assignment | None:
    """The assignment at ``path``, or None when there is none. A malformed file is a
    :class:`ConfigError` naming it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"assignment {path} cannot be read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"assignment {path}: {not_text(exc)}") from exc
    try:
        return Assignment.from_user_data(text)
    except (ValidationError, ValueError) as exc:
        raise ConfigError(f"assignment {path} is not valid: {exc}") from exc


def _key(a: Assignment | RestoreProgress) -> str:
    digest = hashlib.sha256(f"{a.job}|{a.attempt}|{a.image_url}".encode()).hexdigest()[:12]
    return f"{a.job}-{a.attempt}-{digest}"


class RestoreStep(StrEnum):
    """Where an assignment's restore stands on this node."""

    RESTORING = "restoring"  # the intent: recorded before CRIU runs
    RESTORED = "restored"  # the job runs (``pid``)
    FAILED = "failed"  # reported as RESTORE_FAILED; a new assignment is awaited


class RestoreProgress(BaseModel):
    """One assignment's progress, ``{records}/{key}.json`` (fields left unset are not
    written: the file holds what the step knows)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    job: str
    image_url: str
    attempt: int
    state: RestoreStep
    pid: int | None = None  # the restored job (``restored``)
    started: float | None = None  # Unix time the intent was recorded (``restoring``)
    error: str | None = None  # the failure, one line with its type (``failed``)

    @classmethod
    def of(
        cls,
        a: Assignment,
        state: RestoreStep,
        *,
        pid: int | None = None,
        started: float | None = None,
        error: str | None = None,
    ) -> RestoreProgress:
        """``a``'s progress at ``state``."""
        return cls(
            job=a.job,
            image_url=a.image_url,
            attempt=a.attempt,
            state=state,
            pid=pid,
            started=started,
            error=error,
        )

    def to_bytes(self) -> bytes:
        return (self.model_dump_json(indent=2, exclude_none=True) + "\n").encode()


class RestoreRecords:
    """The progress records of the assignments this node was given (one folder)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, a: Assignment | RestoreProgress) -> Path:
        """The record of ``a`` (an assignment, or a record of it: the same job, attempt and
        image name the same file)."""
        return self.folder / f"{_key(a)}.json"

    def load(self, a: Assignment) -> RestoreProgress | None:
        """``a``'s record; None when there is none or it cannot be read (a help, not a
        condition: the restore then runs as if first)."""
        try:
            return RestoreProgress.model_validate_json(self.path(a).read_bytes())
        except (OSError, ValueError):
            return None

    def save(self, progress: RestoreProgress) -> None:
        """Write ``progress`` over its assignment's record (best effort: a full disk is
        logged, not raised)."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            safefs.write_atomic(self.path(progress), progress.to_bytes())
        except OSError as exc:
            log.error(
                "cannot record the assignment's progress",
                extra={"step": "restore", "job": progress.job, "error": str(exc)},
            )


def _restored_meanwhile(a: Assignment, rec: RestoreProgress, state_dir: Path) -> JobInfo | None:
    """The job a restore brought back although its outcome was never recorded: job
    ``a.job`` runs, and its ``job.json`` was written after the restore's intent was."""
    started = rec.started
    try:
        info = resolve_job(a.job, state_dir=state_dir)
        written = (info.dir / JOB_FILE).stat().st_mtime
    except (SpotguardError, OSError):
        return None
    if not info.running():  # its pid and start time: the image's record names another host's
        return None
    if started is None or written < started - 1.0:
        return None  # an older incarnation's record, not this restore's
    return info


async def restore_assignment(
    assignment: Assignment,
    *,
    records: Path,
    state_dir: Path | None = None,
    restore: Callable[[str, str], Awaitable[RestoreResult]],
    reporter: Reporter,
    instance: dict[str, Any],
) -> Restored | None:
    """Restore ``assignment``'s job unless that already happened; report each step.

    ``restore(image_url, job)`` is :func:`spotguard.operations.restore` bound to this host's
    settings. The intent (``restoring``) is recorded before CRIU runs and the outcome after;
    an agent stopped in between finds the restored job (``state_dir``'s jobs; default: the
    state dir above ``records``) instead of restoring it twice. Returns the running job, or
    None when the restore failed (reported as RESTORE_FAILED with the error's type) or had
    failed before.
    """
    book = RestoreRecords(records)
    rec = book.load(assignment)
    if rec is not None:
        state, pid = rec.state, rec.pid
        if state is RestoreStep.RESTORED and pid is not None:
            log.info(
                "assignment already restored",
                extra={"step": "restore", "job": assignment.job, "pid": pid},
            )
            return Restored(assignment.job, pid, assignment.image_url)
        if state is RestoreStep.FAILED:
            log.info(
                "assignment failed before; waiting for a new one",
                extra={"step": "restore", "job": assignment.job, "error": rec.error},
            )
            return None
        if state is RestoreStep.RESTORING and pid is not None and proctree.alive(pid):
            book.save(RestoreProgress.of(assignment, RestoreStep.RESTORED, pid=pid))
            return Restored(assignment.job, pid, assignment.image_url)
        found = _restored_meanwhile(assignment, rec, state_dir or records.parent.parent)
        if state is RestoreStep.RESTORING and found is not None:
            # The intent was recorded, the outcome not: the agent was stopped after CRIU
            # brought the job back. Restoring again would run it twice.
            log.warning(
                "the assigned restore had completed when the agent stopped; not restoring again",
                extra={"step": "restore", "job": assignment.job, "pid": found.pid},
            )
            book.save(RestoreProgress.of(assignment, RestoreStep.RESTORED, pid=found.pid))
            reporter.emit(
                RestoredEvent(
                    job=assignment.job,
                    instance=InstanceInfo.model_validate(instance),
                    image_url=assignment.image_url,
                    attempt=assignment.attempt,
                    pid=found.pid,
                )
            )
            return Restored(assignment.job, found.pid, assignment.image_url)
    # the intent, journaled before CRIU runs (with the time: what it restores is newer)
    book.save(RestoreProgress.of(assignment, RestoreStep.RESTORING, started=time.time()))
    where = InstanceInfo.model_validate(instance)
    reporter.emit(
        RestoringEvent(
            job=assignment.job,
            instance=where,
            image_url=assignment.image_url,
            attempt=assignment.attempt,
        )
    )
    log.info(
        "restoring assigned image",
        extra={"step": "restore", "job": assignment.job, "image": assignment.image_url},
    )
    t0 = time.monotonic()
    try:
        result = await restore(assignment.image_url, assignment.job)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, SpotguardError):
            log.error("restore failed unexpectedly", exc_info=exc, extra={"step": "restore"})
        book.save(RestoreProgress.of(assignment, RestoreStep.FAILED, error=error))
        log.error(
            "restore failed",
            extra={
                "step": "restore",
                "job": assignment.job,
                "error": error.splitlines()[0],
                "seconds": round(time.monotonic() - t0, 3),
            },
        )
        reporter.emit(
            RestoreFailedEvent(
                job=assignment.job,
                instance=where,
                image_url=assignment.image_url,
                attempt=assignment.attempt,
                error=WireError.of(exc),
            )
        )
        return None
    book.save(RestoreProgress.of(assignment, RestoreStep.RESTORED, pid=result.pid))
    seconds = time.monotonic() - t0
    log.info(
        "job restored",
        extra={
            "step": "restored",
            "job": result.job.name,
            "pid": result.pid,
            "seconds": round(seconds, 3),
        },
    )
    reporter.emit(
        RestoredEvent(
            job=assignment.job,
            instance=where,
            image_url=assignment.image_url,
            attempt=assignment.attempt,
            gpu=GpuInfo.model_validate(result.meta.gpu.to_json()),
            timeline=[StepInfo.model_validate(s) for s in result.timeline.to_list()],
            pid=result.pid,
            seconds=seconds,
        )
    )
    return Restored(result.job.name, result.pid, assignment.image_url)
