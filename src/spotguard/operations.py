"""The one composition of "checkpoint a job to a store URL" and "restore an image URL".

Used by the agent and by ``spotguard checkpoint PID --to URL`` / ``spotguard restore URL``.
It only *chooses* where the engine writes and reads and chains the transfer; the engine
(:mod:`spotguard.checkpoint.engine`) stays the only place that orders the freeze steps.

Checkpoint::

    plan (deadline planner, when present) → target:
      streaming (stream.StreamTarget → ImageWriter, dump and upload overlap)   if enabled
      else staging DirectoryTarget (tmpfs or disk) → engine.freeze → image.push_dir
    → one :class:`CheckpointResult` (image URL, bytes, dedup, timeline, GPU, host, instance)

Restore::

    image.pull_dir → staging dir (or stream.StreamSource) → engine.restore (preflight first)
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import gpu_hook
from spotguard.checkpoint.engine import Engine, FreezeResult, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.targets import DirectorySource, DirectoryTarget, plan_staging
from spotguard.config import load
from spotguard.errors import CheckpointError, ImageError, SpotguardError
from spotguard.facts import GpuInventory, HostFacts, InstanceFacts
from spotguard.image import ImageReader, ImageSettings, Manifest, TransferStats, push_dir
from spotguard.image.transfer import pull_to_tmp
from spotguard.planner import Plan, Planner, estimate
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)

URL_SCHEMES = ("s3://", "gs://", "file://")

#: called once the job's state is in host memory (before the upload finishes), with that time
OnFrozen = Callable[[float], None]


def is_url(where: str) -> bool:
    """True for a store URL (``s3://``, ``gs://``, ``file://``); False for a plain path."""
    return where.startswith(URL_SCHEMES)


@dataclass(frozen=True)
class CheckpointResult:
    """What one checkpoint produced: a durable image and how it got there."""

    job: str
    image_url: str
    mode: str
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
    manifest: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "image_url": self.image_url,
            "mode": self.mode,
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


@dataclass(frozen=True)
class RestoreResult:
    """A job running again from an image."""

    job: str
    pid: int
    image_url: str
    timeline: Timeline
    gpu: GpuInventory
    job_dir: Path

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "pid": self.pid,
            "image_url": self.image_url,
            "dir": str(self.job_dir),
            "gpu": self.gpu.to_json(),
            "timeline": self.timeline.to_list(),
        }


def engine_for(settings: CheckpointSettings) -> Engine:
    """The engine for these settings: CRIU plus the GPU hook (a no-op without a GPU)."""
    criu = Criu(settings.criu, timeout=settings.criu_timeout)
    return Engine(criu, gpu_hook(settings.gpu_timeout), settings=settings)


def _frozen_at(fr: FreezeResult) -> tuple[float, float]:
    """(when the state was in host memory, seconds since the freeze began) from the timeline."""
    steps = {s.name: s for s in fr.timeline.steps}
    dump = steps.get("criu_dump")
    first = min(
        (
            s.start
            for s in fr.timeline.steps
            if s.name in ("gpu_lock", "gpu_checkpoint", "criu_dump")
        ),
        default=None,
    )
    if dump is None or dump.end is None or first is None:
        now = time.time()
        return now, 0.0
    return dump.end, dump.end - first


def _plan(
    job: JobInfo,
    store_url: str,
    deadline: datetime | None,
    settings: CheckpointSettings,
    stream: bool,
) -> tuple[Planner | None, Plan | None]:
    """The deadline planner's choice (None when the planner cannot run here)."""
    try:
        planner = Planner(state_dir=settings.state_dir)
        left = (deadline - datetime.now(UTC)).total_seconds() if deadline else None
        plan = planner.plan(
            estimate(job.pid), deadline_s=left, store_url=store_url, stream=stream, pid=job.pid
        )
    except (SpotguardError, OSError) as exc:
        log.warning("deadline planner unavailable", extra={"job": job.name, "error": str(exc)})
        return None, None
    return planner, plan


def _call(on_frozen: OnFrozen | None, frozen_at: float, job: JobInfo) -> None:
    if on_frozen is None:
        return
    try:
        on_frozen(frozen_at)
    except Exception as exc:  # a caller's callback must never lose the image
        log.error("on_frozen callback failed", exc_info=exc, extra={"job": job.name})


class _Progress:
    """Keeps the last transfer counters an image writer reported."""

    def __init__(self) -> None:
        self.stats: TransferStats | None = None

    def __call__(self, stats: TransferStats) -> None:
        self.stats = stats


def _stream_target(
    store_url: str, job: JobInfo, image_settings: ImageSettings | None
) -> tuple[Any, _Progress] | None:
    """A streaming dump target for ``store_url``, or None when streaming is unavailable here
    (then the image is staged and pushed)."""
    try:
        from spotguard.stream.target import StreamTarget
    except ImportError as exc:
        log.info(
            "streaming unavailable; staging the image instead",
            extra={"job": job.name, "step": "plan", "error": str(exc)},
        )
        return None
    progress = _Progress()
    options: dict[str, Any] = {"progress": progress}
    if image_settings is not None:
        options["settings"] = image_settings
    return StreamTarget(store_url, writer_options=options), progress


async def _checkpoint_streamed(
    eng: Engine,
    job: JobInfo,
    mode: Mode,
    stream: tuple[Any, _Progress],
    level: int | None,
    image_meta: dict[str, Any],
    on_frozen: OnFrozen | None,
    planner: Planner | None,
    plan: Plan | None,
    inst: InstanceFacts,
) -> CheckpointResult:
    """Freeze straight into the store: dump, compression and upload overlap; the manifest is
    committed by the target once CRIU succeeded (so the image is durable when freeze returns)."""
    target, progress = stream
    target.level = level
    fr = await eng.freeze(job, target, mode)
    durable_at = time.time()
    frozen_at, freeze_seconds = _frozen_at(fr)
    _call(on_frozen, frozen_at, job)
    fr.timeline.steps.extend(target.timeline_steps)
    manifest = target.manifest
    stats = progress.stats
    total = manifest.totals.bytes if manifest is not None else 0
    raw = stats.bytes if stats is not None else total
    stored = stats.stored_bytes if stats is not None else 0
    if planner is not None and plan is not None:
        planner.record(
            plan,
            seconds={
                "gpu_checkpoint": fr.timeline.seconds("gpu_checkpoint") or 0.0,
                "stream": fr.timeline.seconds("stream_durable") or 0.0,
                "total": durable_at - (frozen_at - freeze_seconds),
            },
            raw_bytes=raw,
            stored_bytes=stored,
        )
    return CheckpointResult(
        job=job.name,
        image_url=str(target.url),
        mode=str(mode),
        bytes=raw,
        stored_bytes=stored,
        skipped_bytes=stats.bytes_skipped if stats is not None else 0,
        timeline=fr.timeline,
        gpu=fr.gpu,
        host=fr.host,
        instance=inst,
        frozen_at=frozen_at,
        freeze_seconds=freeze_seconds,
        pause_seconds=fr.pause_seconds if mode is Mode.RESUME else None,
        durable_at=durable_at,
        streamed=True,
        plan=image_meta.get("plan"),
        manifest=manifest.model_dump(mode="json", exclude={"files"}) if manifest else {},
    )


async def checkpoint(
    job: JobInfo,
    store_url: str,
    *,
    mode: Mode | str = Mode.RESUME,
    settings: CheckpointSettings | None = None,
    engine: Engine | None = None,
    image_settings: ImageSettings | None = None,
    deadline: datetime | None = None,
    instance: InstanceFacts | None = None,
    meta: dict[str, Any] | None = None,
    on_frozen: OnFrozen | None = None,
    stream: bool = False,
) -> CheckpointResult:
    """Checkpoint ``job`` into a new image in the store at ``store_url``.

    Plans against ``deadline`` (when given). With ``stream`` (and streaming available) the
    engine dumps straight into the store (:class:`~spotguard.stream.target.StreamTarget`);
    otherwise into a staging directory (tmpfs or disk, chosen from the memory budget) that is
    then pushed (chunked, deduplicated, manifest last) and removed. ``on_frozen`` is called as
    soon as the state is in host memory (streamed: once the dump ended). In ``exit`` mode the job is
    stopped once its image is complete in staging. Any failure raises a
    :class:`~spotguard.errors.SpotguardError`; the job is never left frozen (the engine's
    guarantee) and no manifest is written for a failed upload (the writer's guarantee).
    """
    s = settings or load(CheckpointSettings)
    eng = engine or engine_for(s)
    m = Mode(mode)
    inst = instance or InstanceFacts()
    stream_target = _stream_target(store_url, job, image_settings) if stream else None
    planner, plan = _plan(job, store_url, deadline, s, stream_target is not None)
    if plan is not None and plan.mode == "keep-periodic":
        raise CheckpointError(
            f"{job.name}: an image cannot be durable before the deadline ({plan.reason})"
        )
    level = plan.level if plan is not None else None
    image_meta: dict[str, Any] = {"instance": inst.to_json(), **(meta or {})}
    if plan is not None:
        image_meta["plan"] = plan.to_json()
    if stream_target is not None:
        return await _checkpoint_streamed(
            eng, job, m, stream_target, level, image_meta, on_frozen, planner, plan, inst
        )
    target = DirectoryTarget(
        shm_root=s.shm_dir, disk_root=s.disk_staging_dir, margin=s.memory_margin
    )
    fr = await eng.freeze(job, target, m)
    frozen_at, freeze_seconds = _frozen_at(fr)
    _call(on_frozen, frozen_at, job)
    image_meta.update(
        mode=str(m),
        gpu=fr.gpu.to_json(),
        host=fr.host.to_json(),
        criu_version=fr.meta.criu_version,
        staging=fr.staging.to_json(),
        frozen_at=datetime.fromtimestamp(frozen_at, UTC).isoformat(),
    )
    try:
        push = await push_dir(
            fr.images_dir,
            store_url,
            job.name,
            image_meta,
            settings=image_settings,
            level=level,
            timeline=fr.timeline,
        )
    except BaseException:
        if m is Mode.EXIT:
            # The job is gone: the staged copy is its only state now. Keep it for a later push.
            log.error(
                "upload failed after the job was stopped; the staged image is kept",
                extra={"job": job.name, "step": "upload", "dir": str(fr.images_dir)},
            )
        else:
            await asyncio.to_thread(shutil.rmtree, fr.images_dir, True)
        raise
    await asyncio.to_thread(shutil.rmtree, fr.images_dir, True)
    durable_at = time.time()
    stats = push.stats
    if planner is not None and plan is not None:
        upload = fr.timeline.seconds("push") or 0.0
        planner.record(
            plan,
            seconds={
                "gpu_checkpoint": fr.timeline.seconds("gpu_checkpoint") or 0.0,
                "criu_dump": fr.timeline.seconds("criu_dump") or 0.0,
                "upload": upload,
                "total": durable_at - (frozen_at - freeze_seconds),
            },
            raw_bytes=stats.bytes,
            stored_bytes=stats.stored_bytes,
        )
    result = CheckpointResult(
        job=job.name,
        image_url=push.image_url,
        mode=str(m),
        bytes=stats.bytes,
        stored_bytes=stats.stored_bytes,
        skipped_bytes=stats.bytes_skipped,
        timeline=fr.timeline,
        gpu=fr.gpu,
        host=fr.host,
        instance=inst,
        frozen_at=frozen_at,
        freeze_seconds=freeze_seconds,
        pause_seconds=fr.pause_seconds if m is Mode.RESUME else None,
        durable_at=durable_at,
        plan=plan.to_json() if plan is not None else None,
        manifest=push.manifest.model_dump(mode="json", exclude={"files"}),
    )
    log.info(
        "checkpoint durable",
        extra={
            "job": job.name,
            "step": "durable",
            "image_url": result.image_url,
            "mode": result.mode,
            "bytes": result.bytes,
            "stored_bytes": result.stored_bytes,
            "skipped_bytes": result.skipped_bytes,
            "seconds": round(durable_at - (frozen_at - freeze_seconds), 3),
        },
    )
    return result


async def _manifest(image_url: str, image_settings: ImageSettings | None) -> Manifest:
    async with ImageReader(image_url, settings=image_settings) as reader:
        return reader.manifest


async def restore(
    image_url: str,
    *,
    settings: CheckpointSettings | None = None,
    engine: Engine | None = None,
    image_settings: ImageSettings | None = None,
    job_name: str | None = None,
    stream: bool = False,
) -> RestoreResult:
    """Restore the image at ``image_url`` (``…/images/latest`` works) on this host.

    A streamed image is served to CRIU straight from the store; any other is downloaded and
    verified into staging (tmpfs when it fits, else disk). Either goes to the engine, whose
    preflight refuses a mismatched host before anything is touched. The job runs again when
    this returns. ``job_name``, when given, must match the image's job. (``stream`` is
    accepted for symmetry; how an image was written decides how it is read.)
    """
    s = settings or load(CheckpointSettings)
    eng = engine or engine_for(s)
    manifest = await _manifest(image_url, image_settings)
    if job_name is not None and manifest.job != job_name:
        raise ImageError(f"{image_url} holds job {manifest.job!r}, not {job_name!r}")
    tl = Timeline()
    need = manifest.totals.bytes
    if "stream" in manifest.meta:
        # Written by a streamed dump: serve CRIU straight from the store, nothing staged.
        from spotguard.stream.target import StreamSource

        tl.mark("staging", mode="stream", path=image_url, reason="streamed image")
        rr = await eng.restore(StreamSource(image_url), state_dir=s.state_dir)
        url = image_url
    else:
        staging = plan_staging(need, s.shm_dir, s.disk_staging_dir, s.memory_margin)
        tl.mark("staging", mode=staging.mode, path=staging.path, reason=staging.reason)
        await asyncio.to_thread(Path(staging.path).mkdir, parents=True, exist_ok=True)
        pulled = await pull_to_tmp(image_url, staging.path, settings=image_settings, timeline=tl)
        try:
            rr = await eng.restore(DirectorySource(pulled.dest), state_dir=s.state_dir)
        finally:
            await asyncio.to_thread(shutil.rmtree, pulled.dest, True)
        url = pulled.image_url
    tl.steps.extend(rr.timeline.steps)
    log.info(
        "image restored",
        extra={
            "job": rr.job.name,
            "step": "restored",
            "pid": rr.pid,
            "image_url": url,
            "bytes": need,
            "seconds": round(tl.span(), 3),
        },
    )
    return RestoreResult(rr.job.name, rr.pid, url, tl, rr.meta.gpu, rr.job.dir)


async def recover(job: JobInfo, *, settings: CheckpointSettings | None = None) -> bool:
    """Bring back ``job`` if a killed process left it mid-freeze (the engine's ``recover``)."""
    s = settings or load(CheckpointSettings)
    return await engine_for(s).recover(job)
