"""A directory as capture sink and serve source: the simplest place an image can stream to.

Used where no object store is wanted (an image kept on this host, tests of the protocol) and
to compare the streamer with CRIU writing files itself. File writes run in a thread so the
event loop keeps draining CRIU's pipes.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from spotguard.errors import StreamError

MiB = 1 << 20


def _safe(root: Path, name: str) -> Path:
    """``root/name`` for a plain file name from CRIU (no directories, no ``..``)."""
    if not name or "/" in name or name in (".", ".."):
        raise StreamError(f"refusing image file name {name!r}")
    return root / name


class DirFile:
    """One file of a :class:`DirSink`: opened with O_TRUNC, as CRIU opens image files."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    async def write(self, data: bytes | memoryview) -> None:
        await asyncio.to_thread(self._write_all, data)

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    async def close(self) -> None:
        os.close(self._fd)


class DirSink:
    """Capture into a directory (the files CRIU would have written itself)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def file(self, name: str) -> DirFile:
        return DirFile(_safe(self.root, name))


class DirSource:
    """Serve files from a directory (an image dumped by CRIU without ``--stream``)."""

    def __init__(self, root: Path, *, read_bytes: int = 8 * MiB) -> None:
        self.root = Path(root)
        self.read_bytes = read_bytes

    def exists(self, name: str) -> bool:
        try:
            return _safe(self.root, name).is_file()
        except StreamError:
            return False

    async def iter_file(self, name: str) -> AsyncIterator[bytes]:
        fd = os.open(_safe(self.root, name), os.O_RDONLY)
        try:
            while data := await asyncio.to_thread(os.read, fd, self.read_bytes):
                yield data
        finally:
            os.close(fd)
