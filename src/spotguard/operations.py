"""The one composition of "checkpoint a job to a store URL" and "restore an image URL".

Used by the agent and by ``spotguard checkpoint PID --to URL`` / ``spotguard restore URL``.
It only *chooses* where the engine writes and reads and chains the transfer; the engine
(:mod:`spotguard.checkpoint.engine`) stays the only place that orders the freeze steps.

Checkpoint::

    stream choice (setting ``stream``: auto = when CRIU has --stream, on, off)
    → plan (deadline planner, when present) → target:
      streaming (stream.StreamTarget → ImageWriter, dump and upload overlap)   by default
      else staging DirectoryTarget (tmpfs or disk) → engine.freeze → image.push_dir
    → one :class:`CheckpointResult` (image URL, bytes, dedup, timeline, GPU, host, instance)

Staging is the fallback, taken automatically (with ``auto``) when the streamer cannot start
(the store refuses the image's first write: nothing of the job has been touched yet) and, in
``exit`` mode, when the stream fails mid-way: the engine completes a streamed exit-mode image
*before* CRIU stops the job, so a failed upload leaves the job running, and the staged copy
then taken is kept for a later push if the store still refuses it (see :func:`kept_images`).

Restore::

    image.pull_dir → staging dir (or stream.StreamSource) → engine.restore (preflight first)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import gpu_hook
from spotguard.checkpoint.engine import Engine, FreezeResult, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.targets import DirectorySource, DirectoryTarget, plan_staging
from spotguard.config import load
from spotguard.errors import (
    CheckpointError,
    CriuError,
    ImageError,
    PreflightError,
    SpotguardError,
    StoreError,
    StreamError,
)
from spotguard.facts import GpuInventory, HostFacts, InstanceFacts
from spotguard.image import ImageReader, ImageSettings, Manifest, TransferStats, push_dir
from spotguard.image.transfer import pull_to_tmp
from spotguard.planner import Plan, Planner, PlannerSettings, estimate
from spotguard.timeline import Timeline

log = logging.getLogger(__name__)

URL_SCHEMES = ("s3://", "gs://", "file://")

StreamChoice = Literal["auto", "on", "off"]

#: the file a kept staged image's directory holds next to CRIU's files (see kept_images)
KEPT_FILE = "spotguard-push.json"

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
    planner_settings: PlannerSettings | None,
) -> tuple[Planner | None, Plan | None]:
    """The deadline planner's choice (None when the planner cannot run here); without
    ``[planner]`` settings from the caller, the planner's built-in defaults (nothing is read)."""
    try:
        ps = planner_settings or PlannerSettings.model_construct()
        planner = Planner(ps, state_dir=settings.state_dir)
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


_STREAM_SUPPORT: dict[str, bool] = {}


async def stream_supported(criu: Criu) -> bool:
    """Whether this CRIU can dump into an image streamer (``--stream`` in its help) and the
    streaming package is importable here. Asked once per CRIU binary per process."""
    if criu.path in _STREAM_SUPPORT:
        return _STREAM_SUPPORT[criu.path]
    ok = False
    try:
        import spotguard.stream.target  # noqa: F401

        proc = await asyncio.create_subprocess_exec(
            criu.path,
            "--help",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 10.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            out = b""
        ok = b"--stream" in out
    except (ImportError, OSError) as exc:
        log.info("streaming unavailable", extra={"step": "plan", "error": str(exc)})
    _STREAM_SUPPORT[criu.path] = ok
    log.info(
        "CRIU image streaming %s", "available" if ok else "unavailable; images are staged",
        extra={"step": "plan", "criu": criu.path, "stream": ok},
    )  # fmt: skip
    return ok


async def _use_stream(choice: StreamChoice, eng: Engine) -> bool:
    """Stream or stage, from the ``stream`` setting and what this host's CRIU can do."""
    if choice == "off":
        return False
    if await stream_supported(eng.criu):
        return True
    if choice == "on":
        raise PreflightError(
            f"stream = on, but {eng.criu.path} cannot dump into an image streamer (--stream)"
        )
    return False


class _StreamTarget:
    """Builds the streaming target and remembers whether it failed before the job was
    touched (the writer could not open the image in the store): then staging is taken."""

    def __init__(self, store_url: str, image_settings: ImageSettings | None, **kw: Any) -> None:
        from spotguard.stream.target import StreamTarget

        self.progress = _Progress()
        options: dict[str, Any] = {"progress": self.progress}
        if image_settings is not None:
            options["settings"] = image_settings
        self.start_error: BaseException | None = None
        self.url = ""  # the image URL, known once the streamer started
        outer = self

        class Guarded(StreamTarget):
            async def start(self, job: str, need_bytes: int) -> Any:
                try:
                    plan = await super().start(job, need_bytes)
                except Exception as exc:
                    outer.start_error = exc
                    raise
                outer.url = self.url or ""
                return plan

        self.target = Guarded(store_url, writer_options=options, **kw)


async def _checkpoint_streamed(
    eng: Engine,
    job: JobInfo,
    mode: Mode,
    stream: _StreamTarget,
    level: int | None,
    image_meta: dict[str, Any],
    on_frozen: OnFrozen | None,
    planner: Planner | None,
    plan: Plan | None,
    inst: InstanceFacts,
) -> CheckpointResult:
    """Freeze straight into the store: dump, compression and upload overlap; the manifest is
    committed by the target once CRIU succeeded (so the image is durable when freeze returns)."""
    target, progress = stream.target, stream.progress
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
        image_url=stream.url,
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
    stream: bool | StreamChoice | None = None,
    planner_settings: PlannerSettings | None = None,
) -> CheckpointResult:
    """Checkpoint ``job`` into a new image in the store at ``store_url``.

    ``stream`` (default: the ``stream`` setting, ``auto``) picks the path: streamed — the
    engine dumps straight into the store (:class:`~spotguard.stream.target.StreamTarget`) —
    when CRIU supports it, else staged: into a staging directory (tmpfs or disk, chosen from
    the memory budget) that is then pushed (chunked, deduplicated, manifest last) and removed.
    ``True``/``False`` mean ``on``/``off``. With ``auto``, staging is also taken when the
    streamer cannot start, and after a stream that failed mid-way in ``exit`` mode (the job
    runs on then: the engine commits the image before CRIU stops the job). Plans against
    ``deadline`` (when given); ``meta`` goes into the manifest either way. ``on_frozen`` is
    called as soon as the state is in host memory (streamed: once the dump ended). In
    ``exit`` mode the job is stopped once its image is complete. Any failure raises a
    :class:`~spotguard.errors.SpotguardError`; the job is never left frozen (the engine's
    guarantee) and no manifest is written for a failed upload (the writer's guarantee). A
    staged exit-mode image whose push failed is kept (:func:`kept_images`, :func:`push_kept`).
    """
    s = settings or load(CheckpointSettings)
    eng = engine or engine_for(s)
    m = Mode(mode)
    inst = instance or InstanceFacts()
    choice: StreamChoice = (
        s.stream if stream is None else ("on" if stream is True else "off")
        if isinstance(stream, bool) else stream
    )  # fmt: skip
    use_stream = await _use_stream(choice, eng)
    planner, plan = _plan(job, store_url, deadline, s, use_stream, planner_settings)
    if plan is not None and plan.mode == "keep-periodic":
        raise CheckpointError(
            f"{job.name}: an image cannot be durable before the deadline ({plan.reason})"
        )
    level = plan.level if plan is not None else None
    image_meta: dict[str, Any] = {"instance": inst.to_json(), **(meta or {})}
    if plan is not None:
        image_meta["plan"] = plan.to_json()
    if use_stream:
        streamed = _StreamTarget(
            store_url, image_settings, meta=image_meta, finish_timeout=s.criu_timeout
        )
        try:
            return await _checkpoint_streamed(
                eng, job, m, streamed, level, image_meta, on_frozen, planner, plan, inst
            )
        except (SpotguardError, OSError) as exc:
            err = _stream_cause(exc, streamed)
            if choice == "on" or not _stage_instead(err, streamed, m, job):
                if err is exc:
                    raise
                raise err from exc
            log.warning(
                "streaming failed before the job was stopped; staging the image instead",
                extra={
                    "job": job.name,
                    "step": "plan",
                    "error": str(exc),
                    "before_freeze": streamed.start_error is not None,
                },
            )
        planner, plan = _plan(job, store_url, deadline, s, False, planner_settings)
        level = plan.level if plan is not None else None
        image_meta.pop("plan", None)
        if plan is not None:
            image_meta["plan"] = plan.to_json()
    return await _checkpoint_staged(
        eng, job, m, s, store_url, level, image_meta, image_settings, on_frozen, planner, plan,
        inst,
    )  # fmt: skip


def _stream_cause(exc: BaseException, streamed: _StreamTarget) -> BaseException:
    """The store's (or image writer's) error when it is what broke the dump: CRIU then only
    saw its pipe close (EPIPE) and fails with a CriuError that hides the cause."""
    cause = streamed.target.capture_error
    if isinstance(exc, CriuError) and isinstance(cause, StoreError | ImageError):
        return cause
    return exc


def _stage_instead(exc: BaseException, streamed: _StreamTarget, mode: Mode, job: JobInfo) -> bool:
    """Whether a failed stream should be retried by staging: the streamer never started
    (nothing was touched), or an exit-mode upload failed and the engine left the job running
    (a staged copy can wait on this host for the store to come back)."""
    if streamed.start_error is not None:
        return True
    from spotguard.checkpoint import proctree

    upload = isinstance(exc, StoreError | ImageError | StreamError)
    return mode is Mode.EXIT and upload and proctree.alive(job.pid)


async def _checkpoint_staged(
    eng: Engine,
    job: JobInfo,
    m: Mode,
    s: CheckpointSettings,
    store_url: str,
    level: int | None,
    image_meta: dict[str, Any],
    image_settings: ImageSettings | None,
    on_frozen: OnFrozen | None,
    planner: Planner | None,
    plan: Plan | None,
    inst: InstanceFacts,
) -> CheckpointResult:
    """Freeze into staging (tmpfs or disk), then push; an exit-mode image whose push fails is
    kept with what a later push needs."""
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
    except BaseException as exc:
        if m is Mode.EXIT:
            # The job is gone: the staged copy is its only state now. Keep it, with what a
            # later push needs, where kept_images() finds it (the agent pushes it again).
            record = _keep(s.state_dir, job.name, fr.images_dir, store_url, image_meta, level,
                           frozen_at, freeze_seconds, exc)  # fmt: skip
            log.error(
                "upload failed after the job was stopped; the staged image is kept",
                extra={
                    "job": job.name,
                    "step": "upload",
                    "dir": str(fr.images_dir),
                    "record": str(record),
                    "error": str(exc),
                },
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
            "image": result.image_url,
            "mode": result.mode,
            "bytes": result.bytes,
            "stored_bytes": result.stored_bytes,
            "skipped_bytes": result.skipped_bytes,
            "seconds": round(durable_at - (frozen_at - freeze_seconds), 3),
        },
    )
    return result


KEPT_DIR = "kept"


@dataclass(frozen=True)
class KeptImage:
    """A staged exit-mode image whose push failed: the job's only state, waiting on this host
    for the store (``{state_dir}/kept/<job>-<dir>.json`` names it)."""

    record: Path
    job: str
    dir: Path
    store_url: str
    meta: dict[str, Any]
    level: int | None
    kept_at: float
    frozen_at: float
    freeze_seconds: float
    error: str

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "dir": str(self.dir),
            "store_url": self.store_url,
            "kept_at": datetime.fromtimestamp(self.kept_at, UTC).isoformat(),
            "error": self.error,
        }


def _keep(
    state_dir: Path,
    job: str,
    images_dir: Path,
    store_url: str,
    meta: dict[str, Any],
    level: int | None,
    frozen_at: float,
    freeze_seconds: float,
    exc: BaseException,
) -> Path | None:
    """Write the record of a kept staged image (None when even that fails: the log line
    holds the directory then)."""
    folder = state_dir / KEPT_DIR
    path = folder / f"{job}-{images_dir.name}.json"
    body = {
        "job": job,
        "dir": str(images_dir),
        "store_url": store_url,
        "meta": meta,
        "level": level,
        "kept_at": time.time(),
        "frozen_at": frozen_at,
        "freeze_seconds": freeze_seconds,
        "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
    }
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = folder / f".{path.name}.tmp"
        tmp.write_text(json.dumps(body, default=str))
        os.replace(tmp, path)
    except OSError as err:
        log.error("cannot record the kept image", extra={"job": job, "error": str(err)})
        return None
    return path


def _host() -> HostFacts:
    return HostFacts.probe(None)


def kept_images(state_dir: Path, *, job: str | None = None) -> list[KeptImage]:
    """Staged images kept after a failed exit-mode push, oldest first (``job``: only its).

    A record whose directory is gone (tmpfs lost in a reboot) cannot be pushed any more: it
    is dropped with an error line. An unreadable record is dropped with a warning."""
    folder = state_dir / KEPT_DIR
    out: list[KeptImage] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            d = json.loads(path.read_text())
            kept = KeptImage(
                record=path,
                job=str(d["job"]),
                dir=Path(d["dir"]),
                store_url=str(d["store_url"]),
                meta=dict(d.get("meta") or {}),
                level=d.get("level"),
                kept_at=float(d["kept_at"]),
                frozen_at=float(d.get("frozen_at") or d["kept_at"]),
                freeze_seconds=float(d.get("freeze_seconds") or 0.0),
                error=str(d.get("error") or ""),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "unreadable kept-image record dropped",
                extra={"step": "upload", "file": str(path), "error": str(exc)},
            )
            path.unlink(missing_ok=True)
            continue
        if not kept.dir.is_dir():
            log.error(
                "a kept image's directory is gone; it cannot be pushed",
                extra={"step": "upload", "job": kept.job, "dir": str(kept.dir)},
            )
            path.unlink(missing_ok=True)
            continue
        if job is None or kept.job == job:
            out.append(kept)
    return sorted(out, key=lambda k: k.kept_at)


async def push_kept(
    kept: KeptImage, *, image_settings: ImageSettings | None = None
) -> CheckpointResult:
    """Push a kept staged image (chunks the store already has are skipped, manifest last);
    once it is durable, remove the staged copy and its record. Raises like ``push_dir``
    (the image stays kept then)."""
    tl = Timeline()
    push = await push_dir(
        kept.dir,
        kept.store_url,
        kept.job,
        kept.meta,
        settings=image_settings,
        level=kept.level,
        timeline=tl,
    )
    kept.record.unlink(missing_ok=True)
    await asyncio.to_thread(shutil.rmtree, kept.dir, True)
    durable_at = time.time()
    stats = push.stats
    m = kept.meta
    result = CheckpointResult(
        job=kept.job,
        image_url=push.image_url,
        mode=str(Mode.EXIT),
        bytes=stats.bytes,
        stored_bytes=stats.stored_bytes,
        skipped_bytes=stats.bytes_skipped,
        timeline=tl,
        gpu=GpuInventory.from_json(m.get("gpu")),
        host=HostFacts.from_json(m["host"]) if isinstance(m.get("host"), dict) else _host(),
        instance=InstanceFacts.from_json(m.get("instance")),
        frozen_at=kept.frozen_at,
        freeze_seconds=kept.freeze_seconds,
        pause_seconds=None,
        durable_at=durable_at,
        plan=m.get("plan"),
        manifest=push.manifest.model_dump(mode="json", exclude={"files"}),
    )
    log.info(
        "kept image durable",
        extra={
            "job": kept.job,
            "step": "durable",
            "image": result.image_url,
            "bytes": result.bytes,
            "stored_bytes": result.stored_bytes,
            "seconds_kept": round(durable_at - kept.kept_at, 3),
        },
    )
    return result


async def _manifest(image_url: str, image_settings: ImageSettings | None) -> tuple[str, Manifest]:
    """The image's own URL (``…/latest`` resolved) and its manifest."""
    async with ImageReader(image_url, settings=image_settings) as reader:
        return reader.url, reader.manifest


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
    resolved, manifest = await _manifest(image_url, image_settings)
    if job_name is not None and manifest.job != job_name:
        raise ImageError(f"{image_url} holds job {manifest.job!r}, not {job_name!r}")
    tl = Timeline()
    need = manifest.totals.bytes
    if "stream" in manifest.meta:
        # Written by a streamed dump: serve CRIU straight from the store, nothing staged.
        from spotguard.stream.target import StreamSource

        tl.mark("staging", mode="stream", path=image_url, reason="streamed image")
        rr = await eng.restore(StreamSource(resolved), state_dir=s.state_dir)
        url = resolved
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
            "image": url,
            "bytes": need,
            "seconds": round(tl.span(), 3),
        },
    )
    return RestoreResult(rr.job.name, rr.pid, url, tl, rr.meta.gpu, rr.job.dir)


async def recover(job: JobInfo, *, settings: CheckpointSettings | None = None) -> bool:
    """Bring back ``job`` if a killed process left it mid-freeze (the engine's ``recover``)."""
    s = settings or load(CheckpointSettings)
    return await engine_for(s).recover(job)
