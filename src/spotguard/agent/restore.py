"""Boot restore: a VM launched by the controller carries an assignment ("restore image X of
job J"); the agent restores the job from it once, then protects it.

The assignment file is written by user-data (:meth:`Assignment.user_data`). Progress is kept
in ``{state_dir}/agent/assignments/{key}.json`` (``key`` = job, attempt and image), so that an
agent restarted after a completed restore does not restore again, and one restarted in the
middle of a restore finds out whether the job came back before trying once more. Those
records are a help, not a condition: when they cannot be written (a full disk) the restore
still runs, and whatever fails is reported as RESTORE_FAILED — the agent never dies on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from spotguard import safefs
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import RestoreResult
from spotguard.checkpoint.jobs import JOB_FILE, JobInfo, resolve_job
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
    try:
        return Assignment.from_user_data(text)
    except (ValidationError, ValueError) as exc:
        raise ConfigError(f"assignment {path} is not valid: {exc}") from exc


def _key(a: Assignment) -> str:
    digest = hashlib.sha256(f"{a.job}|{a.attempt}|{a.image_url}".encode()).hexdigest()[:12]
    return f"{a.job}-{a.attempt}-{digest}"


def _record(dirpath: Path, key: str, data: dict[str, Any]) -> None:
    """Write the assignment's progress (best effort: a full disk is logged, not raised)."""
    try:
        dirpath.mkdir(parents=True, exist_ok=True, mode=0o700)
        safefs.write_atomic(dirpath / f"{key}.json", (json.dumps(data, indent=2) + "\n").encode())
    except OSError as exc:
        log.error(
            "cannot record the assignment's progress",
            extra={"step": "restore", "job": data.get("job"), "error": str(exc)},
        )


def _load(dirpath: Path, key: str) -> dict[str, Any] | None:
    try:
        data = json.loads((dirpath / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _restored_meanwhile(a: Assignment, rec: dict[str, Any], state_dir: Path) -> JobInfo | None:
    """The job a restore brought back although its outcome was never recorded: job
    ``a.job`` runs, and its ``job.json`` was written after the restore's intent was."""
    started = rec.get("started")
    try:
        info = resolve_job(a.job, state_dir=state_dir)
        written = (info.dir / JOB_FILE).stat().st_mtime
    except (SpotguardError, OSError):
        return None
    if not proctree.alive(info.pid):
        return None
    if not isinstance(started, int | float) or written < started - 1.0:
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
    key = _key(assignment)
    rec = _load(records, key)
    base: dict[str, Any] = {
        "job": assignment.job,
        "image_url": assignment.image_url,
        "attempt": assignment.attempt,
    }
    if rec is not None:
        state = rec.get("state")
        pid = rec.get("pid")
        if state == "restored" and isinstance(pid, int):
            log.info(
                "assignment already restored",
                extra={"step": "restore", "job": assignment.job, "pid": pid},
            )
            return Restored(assignment.job, pid, assignment.image_url)
        if state == "failed":
            log.info(
                "assignment failed before; waiting for a new one",
                extra={"step": "restore", "job": assignment.job, "error": rec.get("error")},
            )
            return None
        if state == "restoring" and isinstance(pid, int) and proctree.alive(pid):
            _record(records, key, {**base, "state": "restored", "pid": pid})
            return Restored(assignment.job, pid, assignment.image_url)
        found = _restored_meanwhile(assignment, rec, state_dir or records.parent.parent)
        if state == "restoring" and found is not None:
            # The intent was recorded, the outcome not: the agent was stopped after CRIU
            # brought the job back. Restoring again would run it twice.
            log.warning(
                "the assigned restore had completed when the agent stopped; not restoring again",
                extra={"step": "restore", "job": assignment.job, "pid": found.pid},
            )
            _record(records, key, {**base, "state": "restored", "pid": found.pid})
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
    _record(records, key, {**base, "state": "restoring", "started": time.time()})
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
        _record(records, key, {**base, "state": "failed", "error": error})
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
    _record(records, key, {**base, "state": "restored", "pid": result.pid})
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
