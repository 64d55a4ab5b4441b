"""The two ways an image reaches a store, behind one protocol, and the rule between them.

A :class:`CheckpointPath` has two steps, always called in this order by the chain
(:mod:`.checkpoint`):

``prepare``  readies the path without touching the job (the streamed path opens the image in
             the store here: its first write). A failure here leaves the job as it was.
``run``      freezes the job through the engine into the path's target and makes the image
             durable; returns the one :class:`~.results.CheckpointResult`.

:class:`StreamedPath` dumps straight into the store (CRIU ``--stream`` → capture → image
writer; dump, compression and upload overlap). :class:`StagedPath` dumps into a staging
directory (tmpfs or disk) and pushes it; the staged image is recorded as kept
(:mod:`.kept`) the moment it is complete — before CRIU stops the job in ``exit`` mode — and
the record goes only when the manifest is durable. It is pushed only as this host sealed it
(:func:`spotguard.checkpoint.seal.verify` right before the push, which signs what it uploads):
an image altered in between fails like an upload (the job runs on, or in ``exit`` mode the
image stays kept, :class:`ImageKept` naming the refusal, and is never pushed).

The fallback rule (:data:`FALLBACK` and :data:`NEVER_FALLS_BACK`, applied by
:func:`falls_back`) is declared, not inferred:
the staged path runs after the streamed one when

1. ``prepare`` failed — the store refused the image before the job was touched (never for a
   :class:`ConfigError`, :data:`NEVER_FALLS_BACK`: bad input fails every path alike); or
2. ``run`` failed with an upload error (:class:`StoreError`, :class:`ImageError`,
   :class:`StreamError` — the last also when the stream was not durable within its time) in
   ``exit`` mode. The engine raised, and its contract is that a failed freeze leaves the job
   running; a staged copy can then wait on this host for the store.

Within the staged path, a dump staged in the tmpfs that runs out of room there (``ENOSPC``,
or the tmpfs now holds less than the image: something else filled it) is done again staged
on disk (``disk_staging_dir``) while the deadline leaves time; the engine brought the job
back, so nothing was stopped.

The streamed path's errors are its own typed errors: a CRIU failure caused by the store (CRIU
only sees its pipe close) is raised as the store's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from spotguard.checkpoint import seal
from spotguard.checkpoint.engine import Engine, FreezeResult, Mode
from spotguard.checkpoint.gpupages import PageFill
from spotguard.checkpoint.hold import NO_HOLD, Hold
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.meta import ImageMeta
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectoryTarget, StagingPlan
from spotguard.errors import (
    CheckpointError,
    ConfigError,
    CriuError,
    ImageError,
    SpotguardError,
    StepTimeout,
    StoreError,
    StreamError,
)
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings, TransferStats, push_dir

from .kept import KeptImage, KeptImages, image_meta
from .results import CheckpointResult, Frozen, Landed

if TYPE_CHECKING:
    from spotguard.stream.direct import StreamTarget

log = logging.getLogger(__name__)

#: called once the job's state is in host memory (before the upload finishes), with that time
OnFrozen = Callable[[float], None]

#: upload failures: what makes an exit-mode stream fall back to staging
UPLOAD_ERRORS: tuple[type[Exception], ...] = (StoreError, ImageError, StreamError)

#: The declared fallback rule, streamed → staged: (step that failed, errors, modes).
FALLBACK: tuple[tuple[str, tuple[type[BaseException], ...], frozenset[Mode]], ...] = (
    ("prepare", (Exception,), frozenset(Mode)),
    ("run", UPLOAD_ERRORS, frozenset({Mode.EXIT})),
)
#: ... and the errors after which no path runs, whatever FALLBACK says: bad input (a store
#: URL with no bucket, an extra not installed) fails every path alike, the next one only
#: after it has stopped the job
NEVER_FALLS_BACK: tuple[type[BaseException], ...] = (ConfigError,)


def falls_back(step: str, exc: BaseException, mode: Mode) -> bool:
    """Whether the next path of the chain may run after ``exc`` in ``step`` (see FALLBACK
    and NEVER_FALLS_BACK)."""
    return not isinstance(exc, NEVER_FALLS_BACK) and any(
        step == s and isinstance(exc, errors) and mode in modes for s, errors, modes in FALLBACK
    )


class ImageKept(CheckpointError):
    """The job was stopped and its image is complete on this host, but not in the store: the
    upload failed or ran past the deadline. ``kept`` names it; it is pushed until durable."""

    def __init__(self, message: str, kept: KeptImage) -> None:
        super().__init__(message)
        self.kept = kept


@dataclass(frozen=True)
class Attempt:
    """What one path needs for one checkpoint (built by the chain for each path)."""

    engine: Engine
    job: JobInfo
    mode: Mode
    store_url: str
    settings: CheckpointSettings
    image_settings: ImageSettings
    kept: KeptImages
    instance: InstanceFacts
    meta: dict[str, Any]  # the manifest's meta: instance, reason, notice, plan
    level: int | None
    on_frozen: OnFrozen | None
    budget_s: float | None  # seconds this path may take (the notice's deadline), None: no limit

    @property
    def plan(self) -> dict[str, Any] | None:
        plan = self.meta.get("plan")
        return plan if isinstance(plan, dict) else None

    def frozen(self, fr: FreezeResult) -> Frozen:
        """What the freeze says about the image; tells ``on_frozen`` (a failing callback is
        logged: it must never lose the image)."""
        frozen = Frozen.of(fr, self.instance, self.plan)
        if self.on_frozen is not None:
            try:
                self.on_frozen(frozen.frozen_at)
            except Exception as exc:
                log.error("on_frozen callback failed", exc_info=exc, extra={"job": self.job.name})
        return frozen


class CheckpointPath(Protocol):
    """One way to an image in the store (see the module docstring)."""

    name: ClassVar[str]
    streamed: ClassVar[bool]

    async def prepare(self, a: Attempt) -> None:
        """Ready the path; the job is not touched (a failure lets the next path run)."""
        ...

    async def run(self, a: Attempt) -> CheckpointResult:
        """Freeze the job through the engine and make the image durable."""
        ...

    def measured(self, result: CheckpointResult) -> dict[str, float]:
        """Seconds per stage, for the planner to learn from."""
        ...


@contextlib.asynccontextmanager
async def _within(budget_s: float | None) -> AsyncIterator[None]:
    """Bound a step by the deadline's budget (no bound when None)."""
    if budget_s is None:
        yield
        return
    async with asyncio.timeout(max(budget_s, 0.0)):
        yield


class StreamedPath:
    """Dump straight into the store (:class:`~spotguard.stream.direct.StreamTarget`)."""

    name: ClassVar[str] = "stream"
    streamed: ClassVar[bool] = True

    def __init__(self) -> None:
        self._stats: TransferStats | None = None
        self._target: StreamTarget | None = None  # once prepared (its module loads lazily)
        self._t0 = 0.0

    def _progress(self, stats: TransferStats) -> None:
        self._stats = stats

    async def prepare(self, a: Attempt) -> None:
        from spotguard.stream.direct import StreamTarget

        self._t0 = time.monotonic()
        target = StreamTarget(
            a.store_url,
            level=a.level,
            settings=a.image_settings,
            writer_options={"progress": self._progress},
            meta=a.meta,
            finish_timeout=a.settings.criu_timeout,
        )
        try:
            async with _within(a.budget_s):
                await target.open(a.job.name)
        except TimeoutError as exc:
            await target.abort()
            raise StreamError(
                f"the store did not open the image within {a.budget_s:.0f} s"
            ) from exc
        except BaseException:
            await target.abort()
            raise
        self._target = target

    async def run(self, a: Attempt) -> CheckpointResult:
        target = self._target
        assert target is not None, "run() before prepare()"
        left = None if a.budget_s is None else a.budget_s - (time.monotonic() - self._t0)
        try:
            async with _within(left):
                fr = await a.engine.freeze(a.job, target, a.mode)
        except BaseException as exc:
            await asyncio.shield(target.abort())  # closes the image opened by prepare
            if isinstance(exc, TimeoutError):
                raise StreamError(
                    f"the streamed image of {a.job.name!r} was not durable before the "
                    f"deadline ({a.budget_s:.0f} s); the job was brought back and runs on"
                ) from exc
            cause = target.capture_error
            if isinstance(exc, CriuError) and isinstance(cause, StoreError | ImageError):
                raise cause from exc  # CRIU only saw its pipe close: the store is the cause
            raise
        durable_at = time.time()
        frozen = a.frozen(fr)
        fr.timeline.steps.extend(target.timeline_steps)
        manifest = target.manifest
        assert manifest is not None and target.url is not None  # the freeze committed it
        stats = self._stats or TransferStats(bytes=manifest.totals.bytes)
        landed = Landed(target.url, stats, fr.timeline, durable_at, streamed=True)
        return CheckpointResult.of(frozen, landed)

    def measured(self, result: CheckpointResult) -> dict[str, float]:
        tl = result.timeline
        return {
            "gpu_checkpoint": tl.seconds("gpu_checkpoint") or 0.0,
            "gpu_pages": tl.seconds("gpu_pages") or 0.0,
            "stream": tl.seconds("stream_durable") or 0.0,
            "total": result.seconds,
        }


class _RecordingTarget:
    """A staging :class:`DirectoryTarget` whose ``finish`` also records the image as kept —
    in exit mode before CRIU stops the job — and whose ``abort`` drops that record."""

    stream = False

    def __init__(self, inner: DirectoryTarget, a: Attempt) -> None:
        self.inner = inner
        self.attempt = a
        self.kept: KeptImage | None = None

    @property
    def images_dir(self) -> Path:
        return self.inner.images_dir

    @property
    def extras_dir(self) -> Path:
        return self.inner.extras_dir

    async def start(self, job: str, need_bytes: int, hold: Hold = NO_HOLD) -> StagingPlan:
        return await self.inner.start(job, need_bytes, hold)

    async def drain(self) -> None:
        await self.inner.drain()

    async def put_pages(self, name: str, size: int, fill: PageFill) -> None:
        await self.inner.put_pages(name, size, fill)

    async def finish(self, meta: ImageMeta) -> None:
        await self.inner.finish(meta)
        a, now = self.attempt, time.time()
        fields: dict[str, Any] = {
            "job": a.job.name,
            "images_dir": self.inner.images_dir,
            "store_url": a.store_url,
            "mode": a.mode,
            "meta": image_meta(a.meta, meta, now),
            "level": a.level,
            "frozen_at": now,
        }
        try:
            self.kept = await asyncio.to_thread(a.kept.keep, **fields)
        except CheckpointError as exc:
            # A state dir that cannot be written (full, read-only) never costs the image:
            # the sealed staged copy is adopted from its staging root by a restarted agent.
            log.warning(
                "cannot record the staged image; going on without the record",
                extra={"job": a.job.name, "step": "freeze", "error": str(exc)},
            )
            self.kept = KeptImage(
                record=a.kept.folder / f"{a.job.name}-{self.inner.images_dir.name}.json",
                dir=fields.pop("images_dir"),
                kept_at=now,
                **fields,
            )

    async def abort(self) -> None:
        if self.kept is not None:
            self.kept.record.unlink(missing_ok=True)
            self.kept = None
        await self.inner.abort()


async def _release(a: Attempt, kept: KeptImage) -> None:
    """Drop a staged copy no longer needed; a record that cannot be removed (a read-only
    state dir) is logged, never a failed checkpoint (the next agent finds it pushed)."""
    try:
        await a.kept.release(kept)
    except OSError as exc:
        log.warning(
            "cannot remove the staged image's record",
            extra={"job": a.job.name, "file": str(kept.record), "error": str(exc)},
        )
        await asyncio.to_thread(shutil.rmtree, kept.dir, True)


class StagedPath:
    """Dump into a staging directory (tmpfs or disk, chosen from the memory budget), then push
    it (chunked, deduplicated, manifest last)."""

    name: ClassVar[str] = "stage"
    streamed: ClassVar[bool] = False

    async def prepare(self, a: Attempt) -> None:
        return None

    @staticmethod
    def _target(a: Attempt, *, memory: bool = True) -> _RecordingTarget:
        s = a.settings
        inner = DirectoryTarget(
            shm_root=s.shm_dir,
            disk_root=s.disk_staging_dir,
            margin=s.memory_margin,
            key=seal.HostKey.for_state(s.state_dir),
            memory=memory,
        )
        return _RecordingTarget(inner, a)

    async def _freeze(self, a: Attempt, t0: float) -> tuple[FreezeResult, _RecordingTarget]:
        """The engine's freeze into a staging directory; one that ran out of room in the
        tmpfs is done again on disk while the deadline leaves time (the engine brought the
        job back: nothing was stopped)."""
        target = self._target(a)
        try:
            return await a.engine.freeze(a.job, target, a.mode), target
        except (CheckpointError, OSError) as exc:
            left = None if a.budget_s is None else a.budget_s - (time.monotonic() - t0)
            if not target.inner.ran_out_of_memory_room(exc) or (left is not None and left <= 0):
                raise
            log.warning(
                "the in-memory staging ran out of room during the dump; staging on disk",
                extra={
                    "job": a.job.name, "step": "freeze", "dir": str(a.settings.disk_staging_dir),
                    "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                },
            )  # fmt: skip
        target = self._target(a, memory=False)
        return await a.engine.freeze(a.job, target, a.mode), target

    async def run(self, a: Attempt) -> CheckpointResult:
        t0 = time.monotonic()
        fr, target = await self._freeze(a, t0)
        frozen = a.frozen(fr)
        assert target.kept is not None  # finish() ran: the freeze succeeded
        kept = a.kept.update(
            target.kept, frozen_at=frozen.frozen_at, freeze_seconds=frozen.freeze_seconds
        )
        left = None if a.budget_s is None else a.budget_s - (time.monotonic() - t0)
        try:
            async with _within(left):
                # exactly as this host sealed it, or nothing of it is signed and uploaded
                key = target.inner.key or seal.HostKey.default()
                await asyncio.to_thread(seal.verify, fr.images_dir, key)
                push = await push_dir(
                    fr.images_dir,
                    a.store_url,
                    a.job.name,
                    kept.meta,
                    settings=a.image_settings,
                    level=a.level,
                    timeline=fr.timeline,
                )
        except (Exception, asyncio.CancelledError) as exc:
            await self._not_pushed(a, kept, exc)
            raise
        await _release(a, kept)
        return CheckpointResult.of(
            frozen, Landed(push.image_url, push.stats, fr.timeline, time.time(), False)
        )

    async def _not_pushed(self, a: Attempt, kept: KeptImage, exc: BaseException) -> None:
        """An exit image stays kept (the job is gone: it is all there is) and the failure
        becomes :class:`ImageKept`; a resumed job's staged copy is dropped (it runs on)."""
        late = isinstance(exc, TimeoutError)
        error = "not durable before the deadline" if late else f"{type(exc).__name__}: {exc}"
        error = error.splitlines()[0]
        if isinstance(exc, asyncio.CancelledError):
            return  # the record stays: the next agent pushes the image
        if a.mode is not Mode.EXIT:
            await _release(a, kept)
            if isinstance(exc, SpotguardError):
                return
            kind = StepTimeout if late else CheckpointError
            raise kind(f"{a.job.name}: upload failed ({error}); the job runs on") from exc
        kept = a.kept.update(kept, error=error)
        log.error(
            "upload failed after the job was stopped; the staged image is kept on this host",
            extra={"job": a.job.name, "step": "upload", "dir": str(kept.dir), "error": error},
        )
        raise ImageKept(
            f"{a.job.name}: the job was stopped and its image is kept at {kept.dir} until the "
            f"store takes it ({error})",
            kept,
        ) from exc

    def measured(self, result: CheckpointResult) -> dict[str, float]:
        tl = result.timeline
        return {
            "gpu_checkpoint": tl.seconds("gpu_checkpoint") or 0.0,
            "gpu_pages": tl.seconds("gpu_pages") or 0.0,
            "criu_dump": tl.seconds("criu_dump") or 0.0,
            "upload": tl.seconds("push") or 0.0,
            "total": result.seconds,
        }
