"""What the outside hears of one job's checkpoints: metrics, log lines and reports.

Why a part of its own: :class:`~spotguard.agent.worker.JobWorker` *decides* — which request
runs, when, and what state the job is in after it. Everything it decides is then *told* to
three audiences, each with its own vocabulary: Prometheus (``AgentMetrics``), the operator's
log (one line per step, named from ``spotguard.log.FIELDS``) and the controller (the typed
events of :mod:`spotguard.contracts`, spooled by :class:`~spotguard.agent.reporter.Reporter`,
never awaited). :class:`JobReports` holds that telling in one place, so that an outcome is
said the same way whether it came from a notice's checkpoint or from a kept image that
reached the store later (:meth:`JobWorker.kept_durable`), and so that the worker's state
machine reads without the reporting around it. It holds no state about the job: calling it
changes nothing the worker decides.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from spotguard.contracts import (
    CheckpointFailedEvent,
    ExitedEvent,
    FrozenEvent,
    InstanceInfo,
    JobFinishedEvent,
    Mode,
    NoticeInfo,
    ReadyToRelaunchEvent,
    WireError,
)
from spotguard.errors import (
    CheckpointError,
    GpuError,
    ImageError,
    JobError,
    SpotguardError,
    StoreError,
)
from spotguard.operations import CheckpointResult, ImageKept

from .metrics import AgentMetrics
from .reporter import Reporter

log = logging.getLogger(__name__)


def failed_step(exc: BaseException) -> str:
    """The step a failure belongs to, for ``failures_total{step}``."""
    if isinstance(exc, ImageKept):
        return "upload"
    if isinstance(exc, GpuError):
        return "gpu"
    if isinstance(exc, CheckpointError):
        return "freeze"
    if isinstance(exc, StoreError | ImageError):
        return "upload"
    if isinstance(exc, JobError):
        return "job"
    return "internal"


class JobReports:
    """Metrics, log lines and controller reports of one job (``instance``: where it runs,
    as the reports name it)."""

    def __init__(
        self, job: str, *, reporter: Reporter, metrics: AgentMetrics, instance: dict[str, Any]
    ) -> None:
        self.job = job
        self.reporter = reporter
        self.metrics = metrics
        self.instance = instance

    def _where(self) -> InstanceInfo:
        return InstanceInfo.model_validate(self.instance)

    def frozen(
        self, mode: Mode, notice: dict[str, Any] | None, seen: float, frozen_at: float
    ) -> None:
        """The job's state is in host memory (``seen``: when the notice was received)."""
        self.metrics.notice_to_frozen.labels(self.job).observe(max(0.0, frozen_at - seen))
        self.reporter.emit(
            FrozenEvent(
                job=self.job,
                instance=self._where(),
                notice=NoticeInfo.of(notice),
                mode=mode,
                notice_to_frozen_s=round(frozen_at - seen, 3),
            )
        )

    def failed(
        self, key: str, notice: dict[str, Any] | None, exc: Exception, started: float
    ) -> str:
        """A checkpoint failed: counted by step, logged (with a traceback only for an error
        outside spotguard's tree), reported (``kept`` when its image waits here). Returns
        the one-line error the worker's waiters are given."""
        step = failed_step(exc)
        self.metrics.failures.labels(step).inc()
        error = f"{type(exc).__name__}: {exc}"
        log.error(
            "checkpoint failed; the job stays protected",
            exc_info=None if isinstance(exc, SpotguardError) else exc,
            extra={
                "step": step,
                "job": self.job,
                "notice": key,
                "seconds": round(time.time() - started, 3),
                "error": error.splitlines()[0],
            },
        )
        self.reporter.emit(
            CheckpointFailedEvent(
                job=self.job,
                instance=self._where(),
                notice=NoticeInfo.of(notice),
                error=WireError.of(exc),
                step=step,
                kept=isinstance(exc, ImageKept),
            )
        )
        return error

    def durable(
        self, key: str, notice: dict[str, Any] | None, result: CheckpointResult, seen: float
    ) -> None:
        """An image's manifest is in the store: its sizes and times counted, one log line,
        the DURABLE report (``key``: the notice id, or what the image was taken for)."""
        m, job = self.metrics, self.job
        m.freeze_seconds.labels(job, result.mode).observe(result.freeze_seconds)
        if result.pause_seconds is not None:
            m.pause_seconds.labels(job).observe(result.pause_seconds)
        m.checkpoint_bytes.labels(job).inc(result.bytes)
        m.dedup_bytes.labels(job).inc(result.skipped_bytes)
        span = max(result.durable_at - (result.frozen_at - result.freeze_seconds), 1e-6)
        m.upload_throughput.labels(job).set(result.bytes / span)
        m.checkpoints.labels(job, result.mode).inc()
        m.image_durable(job, result.frozen_at)
        log.info(
            "image durable",
            extra={
                "step": "durable",
                "job": job,
                "notice": key,
                "mode": result.mode,
                "image": result.image_url,
                "bytes": result.bytes,
                "stored_bytes": result.stored_bytes,
                "skipped_bytes": result.skipped_bytes,
                "seconds": round(result.durable_at - seen, 3),
                "freeze_seconds": round(result.freeze_seconds, 3),
                "pause_s": (
                    round(result.pause_seconds, 3) if result.pause_seconds is not None else None
                ),
            },
        )
        self.reporter.emit(result.durable_event(notice=notice, instance=self.instance))

    def exited(self, notice: dict[str, Any] | None, image_url: str, *, drain: bool) -> None:
        """The job was stopped after its image was durable: EXITED, and READY_TO_RELAUNCH
        after a drain (the controller may move it now)."""
        log.info("job stopped after its checkpoint", extra={"step": "exit", "job": self.job})
        self.reporter.emit(
            ExitedEvent(
                job=self.job,
                instance=self._where(),
                notice=NoticeInfo.of(notice),
                image_url=image_url,
            )
        )
        if drain:
            self.reporter.emit(
                ReadyToRelaunchEvent(
                    job=self.job,
                    instance=self._where(),
                    notice=NoticeInfo.of(notice),
                    image_url=image_url,
                )
            )

    def finished(self) -> None:
        """The job's process ended by itself."""
        log.info("job finished by itself", extra={"step": "job", "job": self.job})
        self.reporter.emit(JobFinishedEvent(job=self.job, instance=self._where()))
