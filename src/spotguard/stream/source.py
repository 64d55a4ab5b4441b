"""The engine's restore seam, streamed: :class:`StreamSource` (a ``RestoreSource``).

It serves ``criu restore --stream`` from an image URL: each file CRIU asks for is downloaded,
verified and decompressed (pipelined, ahead of CRIU) and fed into CRIU's pipe
(:mod:`spotguard.stream.serve`, through :class:`~spotguard.stream.sparse.ReaderSource`); the
GPU memory carried beside CRIU is read back by :meth:`StreamSource.get_pages`. Its dump twin,
:class:`~spotguard.stream.direct.StreamTarget`, wrote what it reads: which files are CRIU's
and which travel with the image is under ``meta["stream"]`` in the manifest.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from spotguard.errors import ImageError, StreamError
from spotguard.stream.direct import STREAM_KEY, pipe_bytes, workdir
from spotguard.stream.serve import Serve, ServeStats
from spotguard.stream.sparse import ReaderSource

if TYPE_CHECKING:
    from spotguard.checkpoint.gpupages import PagePut, PageZero
    from spotguard.checkpoint.meta import ImageMeta
    from spotguard.image.buffers import BufferPool
    from spotguard.image.reader import ImageReader
    from spotguard.image.settings import ImageSettings
    from spotguard.image.stats import TransferStats


class StreamSource:
    """Restore straight from an image URL (``RestoreSource`` with ``stream = True``)."""

    stream = True

    def __init__(
        self,
        image_url: str,
        *,
        work_root: Path | None = None,
        settings: ImageSettings,
    ) -> None:
        self.image_url = image_url
        self.work_root = work_root
        self.settings = settings
        self.serve_stats: ServeStats | None = None
        self.reader_stats: TransferStats | None = None  # the image reader's, once closed
        self._work: Path | None = None
        self._reader: ImageReader | None = None
        self._serve: Serve | None = None
        #: the reader authenticated the image under the host's keys (see RestoreSource)
        self.authenticated = False
        self._page_buffers: BufferPool | None = None  # made by the first get_pages
        self._files: ReaderSource | None = None

    @property
    def sparse_bytes(self) -> int:
        """Bytes of all-zero private memory left out of the pages CRIU read
        (:mod:`spotguard.stream.sparse`)."""
        f = self._files
        return 0 if f is None or f.sparse is None else f.sparse.dropped_bytes

    @property
    def images_dir(self) -> Path:
        if self._work is None:
            raise StreamError("StreamSource used before start()")
        return self._work / "criu"

    @property
    def extras_dir(self) -> Path:
        if self._work is None:
            raise StreamError("StreamSource used before start()")
        return self._work / "extras"

    async def start(self) -> ImageMeta:
        """Open the image, fetch its extras, and listen on the serve socket."""
        from spotguard.checkpoint.meta import ImageMeta
        from spotguard.image.reader import ImageReader

        self._work = workdir(self.work_root, "sg-serve-")
        self.images_dir.mkdir()
        self.extras_dir.mkdir()
        reader = ImageReader(self.image_url, settings=self.settings)
        try:
            await reader.open()
            self._reader = reader
            self.authenticated = bool(reader.authenticated)
            info = reader.manifest.meta.get(STREAM_KEY)
            if not isinstance(info, dict):
                raise ImageError(f"{self.image_url} was not written by a streamed dump")
            for name in info.get("extras", []):
                dest = self.extras_dir / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                with dest.open("wb") as f:
                    async for data in reader.iter_file(name):
                        f.write(data)
            meta = ImageMeta.read(self.extras_dir)
            self._files = ReaderSource(
                reader,
                set(info.get("criu_files", [])),
                info.get("renames", {}),
                sparse=self.settings.sparse_restore,
            )
            self._serve = Serve(
                self.images_dir,
                self._files,
                pipe_bytes=pipe_bytes(self.settings),
            )
            await self._serve.start()
        except BaseException:
            await self.abort()
            raise
        return meta

    async def get_pages(
        self,
        name: str,
        size: int,
        put: PagePut,
        *,
        zero: PageZero | None = None,
        in_flight: int | None = None,
    ) -> None:
        """The file's chunks, each verified against its authenticated address as it is read,
        several at once through reused buffers (:mod:`spotguard.stream.pages`); all-zero
        chunks are not fetched and not handed on."""
        from spotguard.checkpoint.gpupages import check_part_name
        from spotguard.stream.pages import page_buffers, write_pages

        if self._reader is None:
            raise StreamError("StreamSource used before start()")
        if self._page_buffers is None:
            self._page_buffers = page_buffers(self._reader)
        buffers, part = self._page_buffers, check_part_name(name)
        await write_pages(self._reader, part, size, put, buffers, zeros=zero, in_flight=in_flight)

    async def finish(self) -> None:
        """CRIU restore exited 0: every file it asked for has been fed."""
        try:
            if self._serve is not None:
                self.serve_stats = await self._serve.wait()
        finally:
            await self._close()

    async def abort(self) -> None:
        if self._serve is not None:
            await self._serve.abort()
        await self._close()

    async def _close(self) -> None:
        if self._page_buffers is not None:
            self._page_buffers.close()
            self._page_buffers = None
        reader, self._reader = self._reader, None
        if reader is not None:
            self.reader_stats = reader.stats
            await reader.aclose()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
