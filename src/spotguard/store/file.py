"""Local-directory store (``file:///path`` or a plain path).

Every write goes to a temporary file in the target directory and is renamed into place (atomic
on POSIX), so a reader never sees part of an object. ``if_absent`` writes (the manifest: the
commit record) use ``link(2)``, which fails when the name exists, and are fsynced with their
directory before ``put`` returns.

Plain writes (chunks) are *not* fsynced one by one: fsyncing every chunk file and its directory
on every put serialised the disk (1.8 s of a 2 GiB push against 0.4 s for one flush at the end).
:meth:`FileStore.sync` fsyncs a batch of keys and their distinct directories concurrently, by
which time the kernel has written most of the data back already; the image writer calls it for
every chunk a manifest refers to, right before writing that manifest. Until then a power loss
can leave a renamed chunk file empty or short (a process crash cannot: the data is in the page
cache); docs/image-format.md ("Durability") says how a writer never trusts such a file.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import cache, partial
from pathlib import Path
from typing import cast

from spotguard.errors import ObjectNotFound, PreconditionFailed, StoreError, StoreUnavailable
from spotguard.store.base import BlockingStore, Data, ObjectInfo, PartsRead, RetryPolicy

_TMP_PREFIX = ".tmp-"
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
#: parts per ``preadv`` of :meth:`FileStore.get_parts` (at most ``IOV_MAX``), each group
#: handed to the caller's ``after`` (which hashes it) once read: a raw chunk's headers and
#: 64 blocks, 8 MiB. Every group costs Python under the one GIL, and a restore reads with one
#: thread per core: on a 16-core GPU host 16 threads read raw chunks at 15.6 GB/s in groups
#: of 16 (1 MiB), 20.2 GB/s in groups of 128, 19.8 in groups of 1024; 8 threads did best
#: with 128 too (docs/benchmarks.md, "Raw chunks through the file store")
_PARTS_GROUP = min(128, _IOV_MAX)
_SYNC_FILE_RANGE_WRITE = 2


@cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; the os module does not wrap it), or None."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


def _start_writeback(fd: int) -> None:
    """Start writing the file's dirty pages to disk now, without waiting for it.

    With gigabytes of RAM the kernel would otherwise keep a whole image's chunks dirty until
    :meth:`FileStore.sync`, which then waits for all of it at once (0.38 s of a 2 GiB push on
    the development VM); started per chunk, the disk writes overlap the compression of the next
    chunks and the sync finds little left (0.05 s). A hint only: failures are ignored.
    """
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rest(parts: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``parts`` with their first ``skip`` bytes dropped."""
    out: list[memoryview] = []
    for p in parts:
        if skip >= len(p):
            skip -= len(p)
            continue
        out.append(p[skip:])
        skip = 0
    return out


def _write_all(fd: int, parts: Sequence[Data]) -> None:
    """Write every buffer of ``parts`` in order with ``writev`` (at most ``IOV_MAX`` at a
    time), resuming after short writes. A raw chunk comes as ~1,000 buffers and one thread
    per core may write at once: the walk is kept short (no new view where a part already
    counts in bytes, an index rather than popping the list's head), since it holds the GIL."""
    views = [p if _in_bytes(p) else memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    k = 0
    while k < len(views):
        n = os.writev(fd, views[k : k + _IOV_MAX])
        while n:  # step past what went out; a partly written buffer keeps its rest
            size = len(views[k])
            if n >= size:
                n -= size
                k += 1
            else:
                views[k] = memoryview(views[k])[n:]
                n = 0


def _in_bytes(p: Data) -> bool:
    """Whether ``len(p)`` counts bytes (so ``writev``'s count can be matched against it)."""
    return type(p) in (bytes, bytearray) or (
        type(p) is memoryview and p.format == "B" and p.ndim == 1 and p.contiguous
    )


class FileStore(BlockingStore):
    """Objects are files under ``root``; keys are relative paths. Writes a list of buffers
    in one ``writev`` (:meth:`put_parts`): a raw chunk goes to the file from the plaintext
    itself, its frame headers between the blocks, with no copy into a frame first."""

    writes_parts = True

    def __init__(
        self,
        root: str | Path,
        *,
        io_workers: int = 16,
        retry: RetryPolicy | None = None,
        fsync: bool = True,
    ) -> None:
        self.root = Path(root).absolute()
        super().__init__(self.root.as_uri(), io_workers=io_workers, retry=retry)
        self.fsync = fsync
        # The root with every link on the way followed, once: objects are named under it
        # (a root reached through a symlink — itself or a parent — lists and writes as any
        # other); the URL keeps the path as given.
        self.real = Path(os.path.realpath(self.root))

    def _path(self, key: str) -> Path:
        p = (self.real / key).resolve()
        if p != self.real and self.real not in p.parents:
            raise StoreError(f"key {key!r} escapes the store root {self.root}")
        return p

    def _put(self, key: str, data: Data, if_absent: bool) -> None:
        self._put_parts(key, [data], if_absent)

    def _put_parts(self, key: str, parts: Sequence[Data], if_absent: bool) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f"{_TMP_PREFIX}{dest.name}.{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, parts)  # straight from the caller's buffers, no copy
                if if_absent and self.fsync:
                    os.fsync(fd)
                elif self.fsync:
                    _start_writeback(fd)
            finally:
                os.close(fd)
            if if_absent:
                try:
                    os.link(tmp, dest)
                except FileExistsError as exc:
                    raise PreconditionFailed(f"{self.url}/{key} already exists") from exc
            else:
                os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        if if_absent and self.fsync:
            _fsync_dir(dest.parent)

    def _fsync_file(self, key: str) -> None:
        fd = os.open(self._path(key), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_folder(self, key: str) -> None:
        _fsync_dir(self._path(key) if key else self.real)

    async def sync(self, keys: Sequence[str]) -> None:
        """fsync every file at ``keys`` and every distinct directory holding one, concurrently
        in the store's thread pool; :class:`ObjectNotFound` when a key is absent."""
        if not self.fsync or not keys:
            return
        dirs = sorted({k.rsplit("/", 1)[0] if "/" in k else "" for k in keys})
        files = [self._call("sync", k, partial(self._fsync_file, k)) for k in keys]
        folders = [self._call("sync", d, partial(self._fsync_folder, d)) for d in dirs]
        await asyncio.gather(*files, *folders)

    def _get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def _get_capped(self, key: str, limit: int) -> bytes:
        with self._path(key).open("rb", buffering=0) as f:
            return f.read(limit + 1)

    def _get_into(self, key: str, buf: memoryview) -> memoryview:
        with self._path(key).open("rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > len(buf):  # larger than the caller can use: a bounded read says so
                return memoryview(f.read(len(buf) + 1))
            got = 0
            while got < size:
                n = f.readinto(buf[got:size])
                if not n:
                    break
                got += n
            return buf[:got]

    reads_parts = True

    def _get_parts(self, key: str, parts: Sequence[memoryview], after: PartsRead) -> int:
        """Read the object into ``parts`` in order (``preadv``), calling ``after(i, j)`` once
        ``parts[i:j]`` are filled; returns the object's size (when it differs from the
        parts' total, not all of them were filled: the caller refuses the object)."""
        with self._path(key).open("rb", buffering=0) as f:
            fd = f.fileno()
            size = os.fstat(fd).st_size
            if size != sum(map(len, parts)):
                return size
            pos = i = 0
            while i < len(parts):
                j = min(len(parts), i + _PARTS_GROUP)
                group = parts[i:j]
                want = sum(map(len, group))
                got = 0
                while got < want:  # a short read resumes within the group
                    n = os.preadv(fd, _rest(group, got) if got else group, pos + got)
                    if n == 0:
                        return pos + got  # shrank meanwhile
                    got += n
                after(i, j)
                pos += want
                i = j
            return size

    def _stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC))

    def _list(self, prefix: str) -> list[ObjectInfo]:
        # Walk the deepest directory the prefix names, then filter by the full prefix.
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(base) if base else self.real
        out: list[ObjectInfo] = []
        if not start.is_dir():
            return out
        for dirpath, _dirs, files in os.walk(start):
            for name in files:
                if name.startswith(_TMP_PREFIX):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.real).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                out.append(ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, UTC)))
        return out

    def _list_dirs(self, prefix: str) -> list[str]:
        start = self._path(prefix) if prefix else self.real
        if not start.is_dir():
            return []
        return [e.name for e in os.scandir(start) if e.is_dir()]

    def _delete(self, key: str) -> None:
        # Empty directories are left alone: removing them could race a concurrent writer's
        # mkdir + create in the same directory.
        self._path(key).unlink(missing_ok=True)

    def _map_error(self, exc: Exception, key: str) -> StoreError | None:
        if isinstance(exc, FileNotFoundError):
            return ObjectNotFound(f"{self.url}/{key} does not exist")
        if isinstance(exc, PermissionError):
            return StoreError(f"{self.url}/{key}: permission denied")
        if isinstance(exc, OSError):
            if exc.errno in (errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ESTALE):
                return StoreUnavailable(f"{self.url}/{key}: {exc.strerror}")
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return StoreError(f"{self.url}/{key}: no room in the store: {exc.strerror}")
            return StoreError(f"{self.url}/{key}: {exc.strerror or exc}")
        return None
