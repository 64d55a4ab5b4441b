"""The agent's start-up checks, before it protects anything.

1. :func:`lock_state_dir` — one agent per state dir: a second one is refused with a clear
   message (two agents on one state dir would both report on, and checkpoint, the same jobs).
2. :func:`check_store` — the store URL is usable here (a bucket named, the SDK of its scheme
   installed, the bucket there and readable, a ``file://`` directory creatable, its symlinks
   resolved once and logged): the agent refuses to start rather than fail at the first
   notice, after the job was stopped.
3. :func:`recover_interrupted` — a job a killed agent (or CLI) left mid-freeze is brought back
   by the engine (``recover``, from the engine's ``operation.json`` marker: the one marker);
   then the partial image a killed park to tmpfs or disk left, of every job, is removed.
4. :func:`warm_gpu` — the driver's checkpoint API and NVML are loaded at start, in the
   background, so the first notice does not pay for it; the host's transparent huge page mode
   is set first (``[agent] transparent_hugepages``, :func:`spotguard.planner.set_thp`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO
from urllib.parse import unquote, urlparse

from spotguard import operations, workdirs
from spotguard.checkpoint import cuda
from spotguard.checkpoint.engine import MARKER
from spotguard.checkpoint.jobs import JobInfo, list_jobs
from spotguard.checkpoint.marker import FALLBACK_DIR, fallback_markers
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import CheckpointFailedEvent, WireError
from spotguard.errors import ConfigError, SpotguardError, StoreError, StoreUnavailable
from spotguard.image import ImageSettings
from spotguard.image.keys import ImageKeys
from spotguard.names import check_job_name
from spotguard.operations.restore import clear_orphans
from spotguard.park import local as park_local
from spotguard.park.settings import ParkSettings
from spotguard.statedir import StateDir
from spotguard.store import open_store
from spotguard.store.base import RetryPolicy
from spotguard.warm import warm_host

from .joblock import holder_of, write_holder
from .metrics import AgentMetrics
from .reporter import Reporter

log = logging.getLogger(__name__)


#: the module each store scheme needs, and the extra that installs it
STORE_SDKS = {"s3": ("boto3", "aws"), "gs": ("google.cloud.storage", "gcp")}


def lock_state_dir(layout: StateDir) -> IO[str]:
    """Hold ``{state_dir}/agent/agent.lock`` for the agent's lifetime (the returned file; the
    lock goes with the process). Raises :class:`ConfigError` when another agent holds it."""
    try:
        layout.agent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # read-write, not append: an append-mode pwrite lands at the end, not at offset 0
        f = os.fdopen(
            os.open(layout.agent_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600), "r+"
        )
    except OSError as exc:
        raise ConfigError(f"cannot use the agent state dir {layout.agent}: {exc.strerror}") from exc
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        other = holder_of(f.fileno()) or "?"
        f.close()
        raise ConfigError(
            f"another agent (pid {other}) already uses the state dir {layout.root}; "
            "stop it, or give this one its own --state-dir"
        ) from exc
    write_holder(f.fileno(), f"{os.getpid()}\n")
    return f


def _writable_dir(url: str, root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"store {url}: cannot create {root}: {exc.strerror}") from exc
    if not os.access(root, os.W_OK):
        raise ConfigError(f"store {url}: {root} is not writable")


#: how long the start-up look at a bucket may take (a store down now is only a warning)
BUCKET_CHECK_S = 5.0


#: listed when no job is named (a discovery-only agent: where it may write is not known yet)
UNUSED_PREFIX = ".spotguard-start-check/"
#: the object an agent writes under its first job's prefix at start (one, overwritten): the
#: store must take an image's writes there (no delete: a VM's role may not have that right)
START_CHECK = ".spotguard-start-check"


def probe_prefix(jobs: Sequence[str]) -> str:
    """The prefix the start check lists: the first of ``jobs`` (the names this agent is told
    to protect, its assignment's first) that is a store name — in the documented deploy a
    VM's role may list only its own job's prefix (``JOB/``) — else an unused one."""
    for name in (j.strip() for j in jobs if not j.strip().isdigit()):  # a pid names no job
        with contextlib.suppress(ValueError):
            return f"{check_job_name(name)}/images/"
    return UNUSED_PREFIX


async def _bucket_exists(url: str, jobs: Sequence[str]) -> None:
    """One listing of a prefix (:func:`probe_prefix`) and, within a job's prefix, one small
    write: a bucket that does not exist, or that these credentials may not read or write, is a
    :class:`ConfigError` now, not a failed image at the first notice; a store that does not
    answer now (it may come back) is a warning."""
    store = open_store(url, retry=RetryPolicy(attempts=1, timeout=BUCKET_CHECK_S))
    prefix = probe_prefix(jobs)
    try:
        async with asyncio.timeout(BUCKET_CHECK_S):
            await store.list(prefix)
            if prefix != UNUSED_PREFIX:  # a job's own prefix: an image must be written there
                job = prefix.split("/", 1)[0]
                await store.put(f"{job}/{START_CHECK}", b"written by a spotguard agent's start\n")
    except (StoreUnavailable, TimeoutError) as exc:
        log.warning(
            "the store does not answer now; going on (images wait for it)",
            extra={"step": "start", "store": url, "error": str(exc) or "timed out"},
        )
    except StoreError as exc:
        raise ConfigError(f"store {url}: {exc}") from exc
    finally:
        await store.aclose()


def _module_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


async def check_store(url: str, image: ImageSettings, jobs: Sequence[str] = ()) -> str:
    """Refuse a store the agent could not write an image to (see the module docstring);
    returns the URL the agent uses from now on (:func:`resolved_store`). ``jobs``: the names
    of the jobs it is told to protect (the store is checked within the first one's prefix)."""
    store = open_store(url)  # ConfigError for an unknown scheme or a URL without a bucket
    await store.aclose()
    scheme = urlparse(url).scheme.lower()
    if scheme in STORE_SDKS:
        module, extra = STORE_SDKS[scheme]
        if not _module_present(module):
            raise ConfigError(
                f"store {url} needs {module}, which is not installed: "
                f"pip install 'spotguard[{extra}]'"
            )
        await _bucket_exists(url, jobs)
    elif scheme in ("", "file"):
        await asyncio.to_thread(_writable_dir, url, Path(unquote(urlparse(url).path) or url))
        url = resolved_store(url)
    ImageKeys.from_settings(image)  # an unreadable key is a ConfigError now, not at a notice
    return url


def resolved_store(url: str) -> str:
    """A ``file://`` store's URL with every symlink on its path (the root or a parent)
    followed, once, at start (logged when it differs): images and kept pushes then go to
    that directory whatever the link points to later."""
    given = Path(unquote(urlparse(url).path) or url).absolute()
    real = Path(os.path.realpath(given))
    if real == given:
        return url
    log.info(
        "the file store is reached through a symlink; using its real path",
        extra={"step": "start", "store": url, "path": str(real)},
    )
    return real.as_uri()


def _jobs_with_a_marker(settings: CheckpointSettings) -> list[JobInfo]:
    """Every job under the state dir, and every ad-hoc (``pid-N``) job directory holding the
    engine's marker (those have no ``job.json``)."""
    jobs = {j.name: j for j in list_jobs(settings.state_dir)}
    root = settings.jobs_dir
    for marker in sorted(root.glob(f"*/{MARKER}")) if root.is_dir() else []:
        name = marker.parent.name
        if name in jobs:
            continue
        try:
            pid = int(json.loads(marker.read_text()).get("job_pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            pid = 0
        jobs[name] = JobInfo(name=name, pid=pid, dir=marker.parent)
    for jdir, data in fallback_markers():  # markers the job's directory could not take
        job_pid = data.get("job_pid")
        if jdir.parent == root and jdir.name not in jobs and isinstance(job_pid, int):
            jobs[jdir.name] = JobInfo(name=jdir.name, pid=job_pid, dir=jdir)
    return list(jobs.values())


async def recover_interrupted(
    settings: CheckpointSettings,
    on_recovered: Callable[[JobInfo, float], None],
    park: ParkSettings | None = None,
) -> list[str]:
    """Bring back every job under the state dir that a killed freeze left behind; call
    ``on_recovered(job, seconds)`` for each; remove the images killed restores staged
    (:func:`spotguard.operations.restore.clear_orphans`) and the work directories of killed
    operations (:func:`spotguard.workdirs.sweep`); then, with ``park``, remove the
    partial parked image of every job (a park killed midway:
    :func:`spotguard.park.local.clear_partials`). Returns the names of the jobs recovered."""
    done = []
    for info in _jobs_with_a_marker(settings):
        t0 = time.monotonic()
        try:
            thawed = await operations.recover(info, settings=settings)
        except SpotguardError as exc:
            log.error(
                "recovery failed", extra={"step": "recover", "job": info.name, "error": str(exc)}
            )
            continue
        if thawed:
            on_recovered(info, time.monotonic() - t0)
            done.append(info.name)
    await asyncio.to_thread(clear_orphans, settings)  # what a killed restore staged
    await asyncio.to_thread(workdirs.sweep)  # and the work directories killed operations left
    if park is not None:
        await asyncio.to_thread(park_local.clear_partials, settings, park)
    return done


def report_recovered(reporter: Reporter, metrics: AgentMetrics) -> Callable[[JobInfo, float], None]:
    """What :func:`recover_interrupted` calls for each job it brought back: a log line, a
    failure counted, and the interrupted checkpoint reported as failed (the job runs on)."""

    def recovered(info: JobInfo, seconds: float) -> None:
        log.info(
            "recovered job left mid-checkpoint",
            extra={"step": "recover", "job": info.name, "seconds": round(seconds, 3)},
        )
        metrics.failures.labels("recover").inc()
        reporter.emit(
            CheckpointFailedEvent(
                job=info.name,
                error=WireError(
                    code="interrupted",
                    message="the agent stopped during a checkpoint; the job runs on",
                    retryable=True,
                ),
                step="recover",
                thawed=True,
            )
        )

    return recovered


async def warm_gpu(thp: str = "keep") -> cuda.Warmed:
    """Load the GPU driver's checkpoint API and NVML (:func:`spotguard.checkpoint.cuda.warm`)
    off the event loop, and say what was found: one log line. Never fails the agent: a
    driver that cannot load now is tried again (and reported) at the first checkpoint.
    ``thp``: the transparent huge page mode to set on the host first (``keep``: none)."""
    from spotguard.planner import set_thp

    await asyncio.to_thread(set_thp, thp)
    try:
        w = await asyncio.to_thread(cuda.warm)
    except Exception as exc:  # noqa: BLE001 - a warm-up must not stop the agent
        log.warning("GPU warm-up failed", extra={"step": "start", "error": str(exc)})
        return cuda.Warmed(False, False, 0.0, str(exc))
    extra = {"step": "start", "gpu_driver": w.driver, "nvml": w.nvml}
    extra["seconds"] = round(w.seconds, 3)
    if w.driver:
        log.info("GPU checkpoint API loaded", extra=extra)
    else:
        log.info("no GPU checkpoint API on this host", extra={**extra, "reason": w.reason})
    return w


def warm_busy(state_dir: Path) -> list[str]:
    """What holds the warm-up back: the engine's crash markers (a job's freeze or restore)
    and the records of container checkpoints and restores (:func:`spotguard.warm.holding_back`)."""
    layout = StateDir(state_dir)
    return [str(layout.jobs / "*" / MARKER), str(FALLBACK_DIR / "*"),
            str(layout.container_busy / "*")]  # fmt: skip


async def warm_memory(setting: str, state_dir: Path) -> None:
    """The host's free memory touched once per boot (``[agent] warm_memory``,
    :mod:`spotguard.warm`), given back the moment any job's freeze or restore starts."""
    await warm_host(setting, StateDir(state_dir).agent / "warmed", warm_busy(state_dir))
