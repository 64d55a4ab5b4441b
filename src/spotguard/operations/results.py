"""The one result of a checkpoint, from the path that made the image durable to the report.

A path (:mod:`.paths`) knows two things about an image: how the job was frozen
(:class:`Frozen`, from the engine's :class:`~spotguard.checkpoint.engine.FreezeResult` or from
a kept image's record) and how the image landed in the store (:class:`Landed`). Both go into
:meth:`CheckpointResult.of` — the only place a :class:`CheckpointResult` is built — and the
agent reports that result as it is (``DURABLE``), keeps it as the job's last image and prints
it from the CLI (:meth:`CheckpointResult.to_json`, :meth:`CheckpointResult.summary`). Its
wire form, the agent's ``DURABLE`` report, is :meth:`CheckpointResult.durable_event`: one shape
from the engine to the controller, built in one place.

A restore returns the engine's :class:`~spotguard.checkpoint.engine.RestoreResult` (with the
image URL it came from): there is one restore result, not a second copy of it here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from spotguard.checkpoint.engine import FreezeResult, Mode, RestoreResult
from spotguard.facts import GpuInventory, HostFacts, InstanceFacts
from spotguard.image import TransferStats
from spotguard.timeline import Timeline

if TYPE_CHECKING:
    from spotguard.contracts import DurableEvent

__all__ = ["CheckpointResult", "Frozen", "Landed", "RestoreResult", "frozen_span"]


def frozen_span(timeline: Timeline) -> tuple[float, float]:
    """(Unix time the job's state was in host memory, seconds since the freeze began), read
    from the engine's timeline (the end of ``criu_dump``; its first GPU/CRIU step's start)."""
    steps = {s.name: s for s in timeline.steps}
    dump = steps.get("criu_dump")
    first = min(
        (s.start for s in timeline.steps if s.name in ("gpu_lock", "gpu_checkpoint", "criu_dump")),
        default=None,
    )
    if dump is None or dump.end is None or first is None:
        return time.time(), 0.0
    return dump.end, dump.end - first


@dataclass(frozen=True)
class Frozen:
    """How the job was frozen: what a result needs from the engine (or a kept record)."""

    job: str
    mode: Mode
    gpu: GpuInventory
    host: HostFacts
    instance: InstanceFacts
    frozen_at: float  # Unix time the job's state was in host memory
    freeze_seconds: float  # freeze start → state in host memory
    pause_seconds: float | None  # how long a resumed job stood still (None: it was stopped)
    plan: dict[str, Any] | None = None

    @classmethod
    def of(
        cls,
        fr: FreezeResult,
        instance: InstanceFacts,
        plan: dict[str, Any] | None,
    ) -> Frozen:
        at, seconds = frozen_span(fr.timeline)
        return cls(
            job=fr.job.name,
            mode=fr.mode,
            gpu=fr.gpu,
            host=fr.host,
            instance=instance,
            frozen_at=at,
            freeze_seconds=seconds,
            pause_seconds=fr.pause_seconds if fr.mode is Mode.RESUME else None,
            plan=plan,
        )


@dataclass(frozen=True)
class Landed:
    """An image whose manifest is in the store, and what its upload moved."""

    image_url: str
    stats: TransferStats
    timeline: Timeline
    durable_at: float  # Unix time the manifest was written
    streamed: bool


@dataclass(frozen=True)
class CheckpointResult:
    """What one checkpoint produced: a durable image and how it got there."""

    job: str
    image_url: str
    mode: Mode
    bytes: int  # image bytes before compression and dedup
    stored_bytes: int  # bytes actually written to the store
    skipped_bytes: int  # image bytes the store already held (dedup)
    timeline: Timeline
    gpu: GpuInventory
    host: HostFacts
    instance: InstanceFacts
    frozen_at: float  # Unix time the job's state was in host memory
    freeze_seconds: float  # freeze start → state in host memory
    pause_seconds: float | None  # how long a resumed job stood still (None: it was stopped)
    durable_at: float  # Unix time the manifest was written
    streamed: bool = False
    plan: dict[str, Any] | None = None

    @classmethod
    def of(cls, frozen: Frozen, landed: Landed) -> CheckpointResult:
        """The result of a freeze whose image landed (the one constructor callers use)."""
        stats = landed.stats
        return cls(
            job=frozen.job,
            image_url=landed.image_url,
            mode=frozen.mode,
            bytes=stats.bytes,
            stored_bytes=stats.stored_bytes,
            skipped_bytes=stats.bytes_skipped,
            timeline=landed.timeline,
            gpu=frozen.gpu,
            host=frozen.host,
            instance=frozen.instance,
            frozen_at=frozen.frozen_at,
            freeze_seconds=frozen.freeze_seconds,
            pause_seconds=frozen.pause_seconds,
            durable_at=landed.durable_at,
            streamed=landed.streamed,
            plan=frozen.plan,
        )

    @property
    def seconds(self) -> float:
        """Freeze start → manifest written."""
        return self.durable_at - (self.frozen_at - self.freeze_seconds)

    def summary(self) -> dict[str, Any]:
        """The short form the agent keeps as a job's last image (status, drain answers)."""
        return {
            "url": self.image_url,
            "frozen_at": datetime.fromtimestamp(self.frozen_at, UTC).isoformat(),
            "durable_at": datetime.fromtimestamp(self.durable_at, UTC).isoformat(),
            "freeze_seconds": round(self.freeze_seconds, 3),
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "skipped_bytes": self.skipped_bytes,
            "mode": self.mode.value,
        }

    def durable_event(
        self, *, notice: dict[str, Any] | None, instance: dict[str, Any]
    ) -> DurableEvent:
        """The ``DURABLE`` report of this result (``notice``: the notice it was taken for;
        ``instance``: the reporting agent's, used when the result names none).

        The wire models are imported here, not at the top: ``spotguard checkpoint`` never
        reports, and building them cost its every run ~0.1 s before the freeze."""
        from spotguard.contracts import (
            DurableEvent,
            GpuInfo,
            HostInfo,
            InstanceInfo,
            NoticeInfo,
            StepInfo,
        )

        return DurableEvent(
            job=self.job,
            instance=InstanceInfo.model_validate(self.instance.to_json() or instance),
            notice=NoticeInfo.of(notice),
            image_url=self.image_url,
            image_bytes=self.bytes,
            mode=self.mode,
            gpu=GpuInfo.model_validate(self.gpu.to_json()),
            host=HostInfo.model_validate(self.host.to_json()),
            timeline=[StepInfo.model_validate(s) for s in self.timeline.to_list()],
            stored_bytes=self.stored_bytes,
            skipped_bytes=self.skipped_bytes,
            freeze_seconds=self.freeze_seconds,
            pause_seconds=self.pause_seconds,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "image_url": self.image_url,
            "mode": self.mode.value,
            "bytes": self.bytes,
            "stored_bytes": self.stored_bytes,
            "skipped_bytes": self.skipped_bytes,
            "frozen_at": self.frozen_at,
            "freeze_seconds": self.freeze_seconds,
            "pause_seconds": self.pause_seconds,
            "durable_at": self.durable_at,
            "streamed": self.streamed,
            "gpu": self.gpu.to_json(),
            "host": self.host.to_json(),
            "instance": self.instance.to_json(),
            "plan": self.plan,
            "timeline": self.timeline.to_list(),
        }
