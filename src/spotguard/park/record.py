"""The record of a parked job: where its state is, since when, why, and how it comes back.

One JSON file per job, ``<state_dir>/parked/<job>.json``, written atomically once the state is
complete (the image's metadata or manifest is written) and removed only after the job runs
again. While it exists the job is parked; nothing else decides that. ``<job>.lock`` (an
``flock``) keeps two park/unpark operations on one job apart — the CLI, the agent's policies
and a wake-on-connect listener may all try at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spotguard import safefs
from spotguard.errors import JobError, JobNotFound, UnsafePath
from spotguard.names import check_job_name
from spotguard.statedir import StateDir

from .sockets import Address

#: memory: suspended in place (GPU state in the process's own host memory, tree stopped);
#: tmpfs / disk: a CRIU image in memory or on disk; store: an image in a store
Place = Literal["memory", "tmpfs", "disk", "store"]


class ListenAddress(BaseModel):
    """A TCP address the job listened on when it was parked."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int

    @classmethod
    def of(cls, addr: Address) -> ListenAddress:
        return cls(host=addr.host, port=addr.port)

    def address(self) -> Address:
        return Address(self.host, self.port)


class ParkRecord(BaseModel):
    """A parked job. ``location`` is a directory (memory, disk) or an image URL (store)."""

    model_config = ConfigDict(frozen=True)

    job: str
    place: Place
    location: str
    since: datetime = Field(default_factory=lambda: datetime.now(UTC))
    reason: str = ""
    bytes: int = 0  # bytes of state held (image size; for a store, before compression)
    gpu_bytes_freed: int = 0  # GPU memory the job held when it was parked (NVML)
    park_seconds: float = 0.0
    listen: tuple[ListenAddress, ...] = ()
    wake_on_connect: bool = False
    waker_pid: int | None = None
    priority: int = 0
    job_dir: str = ""
    pid: int = 0  # the job's root pid (suspended in place: it keeps it)
    gpu_pids: tuple[int, ...] = ()  # GPU processes checkpointed in place
    gpus: tuple[tuple[str, str], ...] = ()  # the host's GPUs when parked: (uuid, model)
    gpu_use: dict[str, int] = Field(default_factory=dict)  # GPU uuid → bytes the job held
    #: parked to a store and reported: the ownership epoch the controller held the job under
    #: then (a later epoch means the controller brought the job back elsewhere)
    controller_epoch: int | None = None

    def to_json(self) -> dict[str, object]:
        return self.model_dump(mode="json")


def parked_dir(state_dir: Path) -> Path:
    return StateDir(state_dir).parked


_MAX_RECORD = 4 << 20


def _path(state_dir: Path, job: str) -> Path:
    try:
        check_job_name(job)
    except ValueError as exc:
        raise JobNotFound(f"no job {job!r}: {exc}") from exc
    return parked_dir(state_dir) / f"{job}.json"


def path(state_dir: Path, job: str) -> Path:
    """Where the job's record is (the engine's crash marker names it for an in-place park:
    a suspend is complete once it exists, a resume once it is gone)."""
    return _path(state_dir, job)


def save(state_dir: Path, rec: ParkRecord) -> None:
    """Write the record atomically (0600: it names where the job's memory is) into the
    private ``parked`` directory (0700, root's; :mod:`spotguard.safefs`), never through a
    link."""
    path = _path(state_dir, rec.job)
    with safefs.opened_private_dir(path.parent) as dfd:
        safefs.write_at(dfd, path.name, (rec.model_dump_json(indent=2) + "\n").encode())


def _read(path: Path) -> bytes:
    with safefs.opened_private_dir(path.parent) as dfd:
        return safefs.read_at(dfd, path.name, limit=_MAX_RECORD)


def load(state_dir: Path, job: str) -> ParkRecord | None:
    """The job's park record, or None when it is not parked. The ``parked`` directory must
    be private to root and the record a regular file (a link is refused)."""
    path = _path(state_dir, job)
    try:
        return ParkRecord.model_validate_json(_read(path))
    except FileNotFoundError:
        return None
    except (OSError, ValidationError, UnsafePath) as exc:
        raise JobError(f"park record {path} is unreadable: {exc}") from exc


def remove(state_dir: Path, job: str) -> None:
    _path(state_dir, job).unlink(missing_ok=True)


def all_records(state_dir: Path) -> list[ParkRecord]:
    """Every parked job on this node (unreadable records are skipped)."""
    root = parked_dir(state_dir)
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.glob("*.json")):
        with contextlib.suppress(OSError, ValidationError, UnsafePath):
            out.append(ParkRecord.model_validate_json(_read(path)))
    return out


def _lock_fd(state_dir: Path, job: str) -> int:
    path = _path(state_dir, job).with_suffix(".lock")
    with safefs.opened_private_dir(path.parent) as dfd:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path.name, flags, 0o600, dir_fd=dfd)


def _busy(job: str) -> JobError:
    return JobError(f"job {job!r} is being parked or unparked right now")


@contextlib.contextmanager
def locked(state_dir: Path, job: str, *, wait: bool = True) -> Iterator[None]:
    """Hold the job's park lock; ``wait=False`` raises :class:`JobError` when it is taken."""
    fd = _lock_fd(state_dir, job)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError as exc:
            raise _busy(job) from exc
        yield
    finally:
        os.close(fd)


def held(state_dir: Path, job: str) -> bool:
    """True while another park/unpark of ``job`` holds its lock (a look, not a hold)."""
    if not _path(state_dir, job).parent.is_dir():
        return False
    try:
        fd = _lock_fd(state_dir, job)
    except (OSError, UnsafePath):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@contextlib.asynccontextmanager
async def alocked(state_dir: Path, job: str, *, wait: bool = True) -> AsyncIterator[None]:
    """:func:`locked` for the event loop: waits by polling, never blocking the loop."""
    fd = _lock_fd(state_dir, job)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError as exc:
                if not wait:
                    raise _busy(job) from exc
            await asyncio.sleep(0.05)
        yield
    finally:
        os.close(fd)
