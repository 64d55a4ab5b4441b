"""Where a dump goes and where a restore comes from: the engine's seams to storage.

A :class:`DumpTarget` gives CRIU an images directory (``stream`` says whether an image
streamer serves CRIU's sockets in it instead of plain files) and a place for the files that
travel with the image; it is started with the expected image size, finished with the image's
metadata, or aborted. :class:`DirectoryTarget` stages in a local directory — in memory
(tmpfs) when RAM allows, else on disk, decided up front — and :class:`DirectorySource` reads
one back. The streaming targets of :mod:`spotguard.stream` implement the same protocols.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import psutil

from spotguard import safefs
from spotguard.errors import CheckpointError, ConfigError, ImageError
from spotguard.image import memops

from . import seal
from .gpupages import PageFill, PagePut, PagesSource, PageZero, check_part_name
from .hold import NO_HOLD, Hold
from .meta import META_NAME, ImageMeta

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagingPlan:
    """Where the image is staged and why: ``tmpfs``, ``disk``, ``dir`` (given) or ``stream``."""

    mode: str
    path: str
    need_bytes: int
    free_bytes: int
    reason: str
    #: bytes of a leave-running image the target keeps in host memory while the job goes on
    #: (:mod:`.hold`); 0 where the job waits for every byte (or CRIU writes files)
    hold_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class DumpTarget(Protocol):
    """Receives one image from the engine."""

    stream: bool

    @property
    def images_dir(self) -> Path:
        """The directory CRIU is pointed at (``-D``); valid after :meth:`start`."""
        ...

    @property
    def extras_dir(self) -> Path:
        """Where the engine puts files that travel with the image (``files/``, metadata)."""
        ...

    async def start(self, job: str, need_bytes: int, hold: Hold = NO_HOLD) -> StagingPlan:
        """Prepare for an image of about ``need_bytes`` of host memory; say where it goes.
        ``hold``: how much of it a streamed target may keep in host memory, beyond its usual
        bound, before it makes the dump wait for the store (a leave-running checkpoint:
        :mod:`.hold`); targets CRIU writes files into ignore it."""
        ...

    async def drain(self) -> None:
        """CRIU has written the image and holds the tree frozen (post-dump) before letting a
        leave-running job go on: take every byte it wrote out of its pipes now. A pipe holds
        references to the job's own pages (CRIU splices them, it does not copy): read after
        the job runs again, they would give the image pages the job changed since. Nothing
        to do where CRIU wrote files."""
        ...

    async def put_pages(self, name: str, size: int, fill: PageFill) -> None:
        """Add file ``name`` of ``size`` bytes to the image, its bytes put by
        ``fill(offset, view)`` (called in a worker thread, one buffer after another): the
        GPU memory spotguard copies beside CRIU (:mod:`.gpupages`). Several run at once."""
        ...

    async def finish(self, meta: ImageMeta) -> None:
        """The dump succeeded: record ``meta`` and make the image complete."""
        ...

    async def abort(self) -> None:
        """The dump failed: drop what was written (never leave a complete-looking image)."""
        ...


class RestoreSource(PagesSource, Protocol):
    """Provides one image to the engine's restore (and the GPU memory staged in it, as a
    :class:`~.gpupages.PagesSource`). ``authenticated`` (valid after
    :meth:`start`): the image was authenticated under a key (the fleet's, or this host's for
    a local image), so restore may honour what it asks beyond the job's own directory.
    ``sparse_bytes`` (valid once CRIU restored): all-zero memory left out of what CRIU wrote
    (:mod:`spotguard.stream.sparse`; 0 for a source that serves every page)."""

    stream: bool
    authenticated: bool

    @property
    def sparse_bytes(self) -> int: ...

    @property
    def images_dir(self) -> Path: ...

    @property
    def extras_dir(self) -> Path: ...

    async def start(self) -> ImageMeta:
        """Make the image available (download, verify, serve) and return its metadata."""
        ...

    async def finish(self) -> None: ...

    async def abort(self) -> None: ...


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (an image directory's size; unreadable ones skipped)."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += (Path(root) / n).lstat().st_size
            except OSError:
                continue
    return total


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def plan_staging(
    need_bytes: int, shm_root: Path, disk_root: Path, margin: int, *, memory: bool = True
) -> StagingPlan:
    """tmpfs when available RAM and the tmpfs both hold ``need_bytes`` + ``margin``, else disk
    (always disk with ``memory=False``: a dump into the tmpfs ran out of room).

    ``need_bytes`` is the host memory the freeze adds: for a GPU job about 2 x GPU state (the
    copy in the process, then the image) + the CPU memory image.
    """
    ram = int(psutil.virtual_memory().available)
    shm = _free_bytes(shm_root)
    free = min(ram, shm)
    if memory and need_bytes + margin <= free:
        reason = f"fits in memory: need {need_bytes} + margin {margin} <= free {free}"
        return StagingPlan("tmpfs", str(shm_root), need_bytes, free, reason)
    disk_free = _free_bytes(disk_root)
    reason = f"memory too small: need {need_bytes} + margin {margin} > free {free}"
    if not memory:
        reason = f"the in-memory staging ran out of room (free now {free})"
    if need_bytes > disk_free:
        raise CheckpointError(
            f"no room to stage the image: need {need_bytes} bytes, memory has {free}, "
            f"{disk_root} has {disk_free}"
        )
    return StagingPlan("disk", str(disk_root), need_bytes, disk_free, reason)


class DirectoryTarget:
    """Stage an image in a directory: the given one, or one chosen by :func:`plan_staging`."""

    stream = False

    def __init__(
        self,
        path: Path | None = None,
        *,
        shm_root: Path = Path("/dev/shm/spotguard"),
        disk_root: Path = Path("/var/lib/spotguard/staging"),
        margin: int = 512 * 1024 * 1024,
        key: seal.HostKey | None = None,
        memory: bool = True,
    ) -> None:
        self._given = path
        self.memory = memory  # False: never the tmpfs (a dump there ran out of room)
        self.key = key
        self._dir: Path | None = path
        self._created = False
        self.shm_root = shm_root
        self.disk_root = disk_root
        self.margin = margin
        self.plan: StagingPlan | None = None

    @property
    def images_dir(self) -> Path:
        if self._dir is None:
            raise CheckpointError("DirectoryTarget used before start()")
        return self._dir

    @property
    def extras_dir(self) -> Path:
        return self.images_dir

    async def start(self, job: str, need_bytes: int, hold: Hold = NO_HOLD) -> StagingPlan:
        """Create the image directory, private to root (0700, checked owned by us and not a
        link all the way down, :mod:`spotguard.safefs`): CRIU's files in it are 0644, so
        only the directory keeps other users from reading the job's memory or swapping it."""
        if self._given is not None:
            d = self._given
            if d.exists() and not d.is_dir():
                raise ConfigError(f"{d} is not a directory: give a directory for the image")
            if (d / META_NAME).exists():
                raise CheckpointError(f"{d} already holds an image; choose an empty directory")
            self._created = not d.exists()
            try:
                safefs.ensure_private_dir(d)
            except OSError as exc:  # bad input (a path under /proc, a read-only mount)
                raise ConfigError(f"cannot make {d} for the image: {exc.strerror}") from exc
            self.plan = StagingPlan("dir", str(d), need_bytes, _free_bytes(d), "given directory")
        else:
            plan = plan_staging(
                need_bytes, self.shm_root, self.disk_root, self.margin, memory=self.memory
            )
            stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
            d = Path(plan.path) / f"{job}-{stamp}"
            root = safefs.private_dir(Path(plan.path))
            try:
                os.mkdir(d.name, safefs.PRIVATE_DIR, dir_fd=root)
            finally:
                os.close(root)
            safefs.ensure_private_dir(d)
            self._created = True
            self.plan = plan
        self._dir = d
        log.info(
            "staging image",
            extra={
                "staging": self.plan.mode,
                "dir": str(d),
                "need_bytes": need_bytes,
                "reason": self.plan.reason,
            },
        )
        return self.plan

    async def drain(self) -> None:
        """CRIU wrote files: nothing is left in a pipe."""

    async def put_pages(self, name: str, size: int, fill: PageFill) -> None:
        """A file of the directory, written in one thread buffer by buffer (sealed with the
        rest by :meth:`finish`)."""
        path = self.images_dir / check_part_name(name)
        await asyncio.to_thread(_write_part, path, size, fill)

    async def finish(self, meta: ImageMeta) -> None:
        """Write the metadata, then seal the directory under the host's key
        (:mod:`.seal`): a local image restores only as it was dumped."""
        meta.write(self.images_dir)
        await asyncio.to_thread(seal.seal, self.images_dir, self.key or seal.HostKey.default())

    async def abort(self) -> None:
        if self._dir is None or self.plan is None:  # start() never got to a directory
            return
        if self._created:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            (self._dir / META_NAME).unlink(missing_ok=True)

    def ran_out_of_memory_room(self, exc: BaseException) -> bool:
        """Whether a dump staged in the tmpfs failed for lack of room there (ENOSPC named by
        the failure, or the tmpfs holds less than the image now that the dump's files are
        gone): disk staging may still take it."""
        if self.plan is None or self.plan.mode != "tmpfs":
            return False
        text = f"{exc} {exc.__cause__ or ''}"
        if "No space left" in text or getattr(exc, "errno", None) == errno.ENOSPC:
            return True
        return _free_bytes(self.shm_root) < self.plan.need_bytes + self.margin


class DirectorySource:
    """An image in a local directory: one written by :class:`DirectoryTarget` (its seal is
    checked under the host's key before anything is read, and the directory must be private
    to root), or one a store reader already authenticated and pulled (``verified_by``: the
    reader's ``authenticated``, "" on a host without keys).

    ``authenticated`` tells restore whether to honour what only an authenticated image may
    ask (a carried file outside the job's directory, :mod:`.files`)."""

    stream = False

    def __init__(
        self, path: Path, *, key: seal.HostKey | None = None, verified_by: str | None = None
    ) -> None:
        self.path = path
        self.key = key
        self.verified_by = verified_by
        self.authenticated = False
        self.sparse_bytes = 0  # CRIU reads the files as they are

    @property
    def images_dir(self) -> Path:
        return self.path

    @property
    def extras_dir(self) -> Path:
        return self.path

    async def start(self) -> ImageMeta:
        safefs.ensure_private_dir(self.path)
        if self.verified_by is None:
            await asyncio.to_thread(seal.verify, self.path, self.key or seal.HostKey.default())
            self.authenticated = True
        else:
            self.authenticated = bool(self.verified_by)
        return ImageMeta.read(self.path)

    async def get_pages(
        self,
        name: str,
        size: int,
        put: PagePut,
        *,
        zero: PageZero | None = None,
        in_flight: int | None = None,
    ) -> None:
        """The directory's file (its seal was verified by :meth:`start`), read in order."""
        path = self.path / check_part_name(name)
        await asyncio.to_thread(_read_part, path, size, put, zero, in_flight or 1)

    async def finish(self) -> None:
        return None

    async def abort(self) -> None:
        return None


#: bytes one buffer of :func:`_write_part` / :func:`_read_part` holds
PART_BUFFER = 64 << 20
#: most threads reading one part at once (each with a buffer of PART_BUFFER bytes)
MAX_PART_READERS = 8


def _write_part(path: Path, size: int, fill: PageFill) -> None:
    buf = mmap.mmap(-1, min(PART_BUFFER, max(size, 1)))
    view = memoryview(buf)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        for off in range(0, size, len(buf)):
            n = min(len(buf), size - off)
            fill(off, view[:n])
            done = 0
            while done < n:
                done += os.pwrite(fd, view[done:n], off + done)
    finally:
        os.close(fd)
        view.release()
        buf.close()


def _read_part(
    path: Path, size: int, put: PagePut, zero: PageZero | None = None, in_flight: int = 1
) -> None:
    """The part's pieces in order, ``in_flight`` at once (a thread and a buffer each)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    local = threading.local()
    buffers: list[mmap.mmap] = []
    views: list[memoryview] = []

    def one(off: int) -> None:
        if not hasattr(local, "view"):
            buf = mmap.mmap(-1, min(PART_BUFFER, max(size, 1)))
            buffers.append(buf)
            local.view = memoryview(buf)
            views.append(local.view)
        view: memoryview = local.view
        n = min(len(view), size - off)
        got = 0
        while got < n:
            r = os.preadv(fd, [view[got:n]], off + got)
            if r <= 0:
                raise ImageError(f"{path} ends at {off + got} of {size} bytes")
            got += r
        if not memops.is_zero(view[:n]):
            put(off, view[:n])
        elif zero is not None:
            zero(off, n)

    try:
        if os.fstat(fd).st_size != size:
            raise ImageError(f"{path} holds {os.fstat(fd).st_size} bytes, the image says {size}")
        pieces = range(0, size, min(PART_BUFFER, max(size, 1)))
        if in_flight <= 1:
            for off in pieces:
                one(off)
        else:
            with ThreadPoolExecutor(min(in_flight, MAX_PART_READERS)) as ex:
                list(ex.map(one, pieces))
    finally:
        os.close(fd)
        for v in views:
            v.release()
        for buf in buffers:
            buf.close()
