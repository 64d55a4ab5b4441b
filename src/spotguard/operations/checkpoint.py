"""Checkpoint a job into a store: the chain, in order, in one place.

::

    1. choose   the paths to try, from the ``stream`` setting and this CRIU
                (auto: [streamed, staged] when CRIU has --stream, else [staged];
                 on: [streamed]; off: [staged])
    2. plan     per path: the deadline planner's codec level (or "keep the periodic image")
    3. prepare  the path, without touching the job
    4. run      freeze through the engine into the path's target; image durable
       ↳ on failure: the next path runs when the declared rule says so
         (:data:`spotguard.operations.paths.FALLBACK`), else the error is raised
    5. learn    the planner records what each stage took

The deadline bounds every path: a store that stalls cannot keep a job frozen past the notice's
deadline. The streamed path gets the time left minus the planner's margin (so that a staged
copy can still be taken in exit mode); in resume mode the engine brings the job back and the
failure is reported, in exit mode the staged copy is kept on this host and pushed until
durable (:class:`~spotguard.operations.paths.ImageKept`). The engine (:mod:`spotguard.checkpoint.
engine`) stays the only place that orders the freeze steps.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from spotguard.checkpoint import gpupages
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import gpu_hook
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import CheckpointError, PreflightError, SpotguardError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings
from spotguard.planner import Plan, Planner, PlannerSettings, estimate
from spotguard.store import check_url, looks_like_url

from .kept import KeptImages
from .paths import Attempt, CheckpointPath, OnFrozen, StagedPath, StreamedPath, falls_back
from .results import CheckpointResult

log = logging.getLogger(__name__)

StreamChoice = Literal["auto", "on", "off"]


def is_url(where: str) -> bool:
    """True for a destination written as a URL (``s3://``, ``gs://``, ``file://``, or any
    other ``scheme://``: refused by :func:`checkpoint` before the job is touched); False for a
    plain path."""
    return looks_like_url(where)


def engine_for(settings: CheckpointSettings) -> Engine:
    """The engine for these settings: CRIU plus the GPU hook (a no-op without a GPU)."""
    criu = Criu(settings.criu, timeout=settings.criu_timeout, log_level=settings.criu_log_level)
    return Engine(criu, gpu_hook(settings.gpu_timeout), settings=settings)


def kept_images_of(settings: CheckpointSettings) -> KeptImages:
    """The kept images of the host these settings describe."""
    return KeptImages(settings.state_dir, [settings.shm_dir, settings.disk_staging_dir])


_STREAM_SUPPORT: dict[str, bool] = {}


async def stream_supported(criu: Criu) -> bool:
    """Whether this CRIU can dump into an image streamer (``--stream`` in its help) and the
    streaming package is importable here. Asked once per CRIU binary per process."""
    if criu.path in _STREAM_SUPPORT:
        return _STREAM_SUPPORT[criu.path]
    ok = False
    try:
        import spotguard.stream.direct  # noqa: F401

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


async def choose_paths(choice: StreamChoice, eng: Engine) -> list[CheckpointPath]:
    """Step 1: the paths to try, in order."""
    if choice == "off":
        return [StagedPath()]
    if await stream_supported(eng.criu):
        return [StreamedPath()] if choice == "on" else [StreamedPath(), StagedPath()]
    if choice == "on":
        raise PreflightError(
            f"stream = on, but {eng.criu.path} cannot dump into an image streamer (--stream)"
        )
    return [StagedPath()]


class _Planning:
    """Step 2 and 5: the deadline planner, when it can run here (its absence never stops a
    checkpoint: it only picks the codec level)."""

    def __init__(
        self, settings: PlannerSettings, state_dir: Path, job: JobInfo, store_url: str
    ) -> None:
        self.planner: Planner | None = None
        self.job = job
        self.store_url = store_url
        # what the CRIU at hand does (:meth:`for_job`): dumps the job's processes at once
        # (the planner spreads the image over them once it has measured the host's combined
        # rate); copies the GPU memory beside CRIU, at its own rate
        self.parallel = False
        self.beside = False
        try:
            self.planner = Planner(settings, state_dir=state_dir)
        except (SpotguardError, OSError) as exc:
            log.warning("deadline planner unavailable", extra={"job": job.name, "error": str(exc)})

    @classmethod
    async def for_job(
        cls,
        eng: Engine,
        settings: CheckpointSettings,
        planner_settings: PlannerSettings | None,
        job: JobInfo,
        store_url: str,
    ) -> _Planning:
        """The planning of ``job``'s checkpoints with ``eng``'s CRIU: what
        :func:`checkpoint` plans by and :func:`exit_fits` asks."""
        planning = cls(
            planner_settings or PlannerSettings.model_construct(), settings.state_dir, job,
            store_url,
        )  # fmt: skip
        planning.parallel = bool(await eng.criu.page_worker_args())  # patched CRIU: at once
        planning.beside = await gpupages.carried_beside(eng.criu, settings.gpu_pages)
        return planning

    @property
    def margin_s(self) -> float:
        return self.planner.settings.margin_s if self.planner is not None else 0.0

    def plan(self, streamed: bool, left_s: float | None) -> Plan | None:
        """The plan of a path (``streamed`` or staged) with ``left_s`` seconds to the
        deadline (None: none); None where the planner cannot say."""
        if self.planner is None:
            return None
        try:
            est = estimate(self.job.pid)
            return self.planner.plan(
                est, deadline_s=left_s, store_url=self.store_url, stream=streamed,
                pid=self.job.pid, parallel=self.parallel, beside=self.beside,
            )  # fmt: skip
        except (SpotguardError, OSError) as exc:
            log.warning("deadline planner failed", extra={"job": self.job.name, "error": str(exc)})
            return None

    def record(self, plan: Plan | None, path: CheckpointPath, result: CheckpointResult) -> None:
        if self.planner is None or plan is None:
            return
        try:
            self.planner.record(
                plan,
                seconds=path.measured(result),
                raw_bytes=result.bytes,
                stored_bytes=result.stored_bytes,
            )
        except (SpotguardError, OSError) as exc:
            log.warning("planner could not learn", extra={"job": self.job.name, "error": str(exc)})


def _left(deadline: datetime | None) -> float | None:
    return None if deadline is None else (deadline - datetime.now(UTC)).total_seconds()


async def exit_fits(
    job: JobInfo,
    store_url: str,
    *,
    settings: CheckpointSettings,
    planner_settings: PlannerSettings | None,
    deadline: datetime,
    engine: Engine | None = None,
) -> bool:
    """Whether an exit checkpoint of ``job`` started now is predicted durable before
    ``deadline`` — as :func:`checkpoint` would plan its first path. True where the planner
    cannot say (an exit then goes ahead too). What a leave-running checkpoint under way asks
    before it gives way to a notice's exit (:mod:`spotguard.agent.worker`)."""
    eng = engine or engine_for(settings)
    chain = await choose_paths(settings.stream, eng)
    planning = await _Planning.for_job(eng, settings, planner_settings, job, store_url)
    plan = await asyncio.to_thread(planning.plan, chain[0].streamed, _left(deadline))
    return plan is None or plan.fits


async def checkpoint(
    job: JobInfo,
    store_url: str,
    *,
    mode: Mode = Mode.RESUME,
    settings: CheckpointSettings,
    image_settings: ImageSettings,
    planner_settings: PlannerSettings | None = None,
    engine: Engine | None = None,
    deadline: datetime | None = None,
    instance: InstanceFacts | None = None,
    meta: dict[str, Any] | None = None,
    on_frozen: OnFrozen | None = None,
    stream: StreamChoice | None = None,
) -> CheckpointResult:
    """Checkpoint ``job`` into a new image in the store at ``store_url`` (the chain above).

    ``stream`` overrides the ``stream`` setting. The deadline planner (``planner_settings``;
    None: its built-in defaults, nothing is read) plans against ``deadline``; ``meta`` goes
    into the manifest.
    ``on_frozen`` is called as soon as the state is in host memory. In ``exit`` mode the job
    is stopped once its image is complete. Any failure raises a
    :class:`~spotguard.errors.SpotguardError`; the job is never left frozen (the engine's
    guarantee) and no manifest is written for a failed upload (the writer's). An exit whose
    staged image could not be pushed raises :class:`~spotguard.operations.paths.ImageKept`.
    """
    check_url(store_url)  # bad input is refused before anything is done to the job
    eng = engine or engine_for(settings)
    chain = await choose_paths(stream or settings.stream, eng)
    planning = await _Planning.for_job(eng, settings, planner_settings, job, store_url)
    inst = instance or InstanceFacts()
    base: dict[str, Any] = {"instance": inst.to_json(), **(meta or {})}
    for i, path in enumerate(chain):
        more = i + 1 < len(chain)
        left = _left(deadline)
        plan = planning.plan(path.streamed, left)
        if plan is not None and plan.mode == "keep-periodic":
            raise CheckpointError(
                f"{job.name}: an image cannot be durable before the deadline ({plan.reason})"
            )
        budget = None if left is None else left - (planning.margin_s if more else 0.0)
        attempt = Attempt(
            engine=eng,
            job=job,
            mode=mode,
            store_url=store_url,
            settings=settings,
            image_settings=image_settings,
            kept=kept_images_of(settings),
            instance=inst,
            meta={**base, "plan": plan.to_json()} if plan is not None else dict(base),
            level=plan.level if plan is not None else None,
            on_frozen=on_frozen,
            budget_s=budget,
        )
        step = "prepare"
        try:
            await path.prepare(attempt)
            step = "run"
            result = await path.run(attempt)
        except (SpotguardError, OSError) as exc:
            if not (more and falls_back(step, exc, mode)):
                raise
            log.warning(
                "%s path failed before the job was stopped; trying the next path",
                path.name,
                extra={"job": job.name, "step": step, "mode": path.name, "error": str(exc)},
            )
            continue
        planning.record(plan, path, result)
        log.info(
            "checkpoint durable",
            extra={
                "job": job.name,
                "step": "durable",
                "path": path.name,
                "image": result.image_url,
                "mode": result.mode,
                "bytes": result.bytes,
                "stored_bytes": result.stored_bytes,
                "skipped_bytes": result.skipped_bytes,
                "seconds": round(result.seconds, 3),
            },
        )
        return result
    raise CheckpointError(f"{job.name}: no checkpoint path left")  # unreachable: chain >= 1
