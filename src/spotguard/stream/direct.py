"""The engine's dump seam, streamed: :class:`StreamTarget` (a ``DumpTarget``); its restore
twin, :class:`~spotguard.stream.source.StreamSource`, is in :mod:`spotguard.stream.source`.

``StreamTarget`` points CRIU (``--stream``) at a small local directory whose capture socket
feeds an :class:`~spotguard.image.ImageWriter` directly: CRIU's dump, chunking, zstd frames
and uploads run at the same time and no staging copy of the image ever exists. Host memory
stays near the job's own memory plus the writer's bounded in-flight chunks. The image becomes
visible only when :meth:`StreamTarget.finish` commits the manifest, after CRIU exited 0; a
failed or killed dump (``abort``) leaves chunks nobody references and no manifest.

Which files are CRIU's and which travel with the image (the engine's ``extras_dir``: captured
output files, metadata) is recorded under ``meta["stream"]`` in the manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotguard import workdirs
from spotguard.errors import StreamError
from spotguard.stream import pipes, protocol
from spotguard.stream.capture import Capture, CaptureStats
from spotguard.timeline import Step, Timeline

if TYPE_CHECKING:
    from spotguard.checkpoint.gpupages import PageFill
    from spotguard.checkpoint.hold import Hold
    from spotguard.checkpoint.meta import ImageMeta
    from spotguard.checkpoint.staging import StagingPlan
    from spotguard.image.buffers import Lease
    from spotguard.image.manifest import Manifest
    from spotguard.image.settings import ImageSettings
    from spotguard.image.stats import TransferStats
    from spotguard.image.writer import FileSink, ImageWriter
    from spotguard.store.base import ImageStore

log = logging.getLogger(__name__)

MiB = 1 << 20
STREAM_KEY = "stream"


class _ImageFileOut:
    """A captured file going into the image writer; renamed when CRIU writes a name twice."""

    def __init__(self, sink: FileSink) -> None:
        self._sink = sink

    async def write(self, data: memoryview) -> None:
        # The writer copies the piece into its pooled chunk buffer before returning.
        await self._sink.write(data)

    async def write_owned(self, data: memoryview, owner: Lease) -> bool:
        # A whole chunk read straight from CRIU's pipe: compressed where it lies, no copy.
        return await self._sink.write_owned(data, owner)

    async def close(self) -> None:
        await self._sink.close()


class ImageSink:
    """:class:`~spotguard.stream.capture.CaptureSink` over an open ``ImageWriter``.

    CRIU opens image files with O_TRUNC, so a name written twice means the newer content
    wins; the image keeps both (the writer never replaces a file) and ``renames`` says which
    stored name is the current one.
    """

    def __init__(self, writer: ImageWriter) -> None:
        self.writer = writer
        self.names: list[str] = []
        self.renames: dict[str, str] = {}
        self._seen: dict[str, int] = {}

    def file(self, name: str) -> _ImageFileOut:
        n = self._seen.get(name, 0) + 1
        self._seen[name] = n
        stored = name if n == 1 else f"{name}.v{n}"
        if n > 1:
            self.renames[name] = stored
        else:
            self.names.append(name)
        return _ImageFileOut(self.writer.file(stored))


_SUN_PATH_MAX = 107  # bytes of a unix socket path (sockaddr_un.sun_path, NUL excluded)


def workdir(root: Path | None, prefix: str) -> Path:
    """A private work dir whose socket paths fit a unix socket address; falls back to
    ``/tmp`` when ``root`` is too deep (CRIU and we both bind/connect by path)."""
    base = root or workdirs.temp_root()
    owner = len("4194304.9999999999-")  # the owner's pid and start time (workdirs)
    longest = len("/criu/") + len(protocol.CAPTURE_SOCKET) + 16 + owner
    if len(os.fsencode(base)) + len(prefix) + longest > _SUN_PATH_MAX:
        base = Path("/tmp")
    base.mkdir(parents=True, exist_ok=True)
    return workdirs.make(prefix, base)


def _walk(root: Path) -> list[tuple[Path, str]]:
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for f in sorted(files):
            p = Path(dirpath) / f
            if p.is_file() and not p.is_symlink():
                out.append((p, p.relative_to(root).as_posix()))
    return out


def _step(
    out: list[Step], timeline: Timeline | None, name: str, start: float, end: float, **detail: Any
) -> None:
    step = Step(name=name, start=start, seconds=end - start, detail=detail)
    out.append(step)
    if timeline is not None:
        timeline.steps.append(step)


class StreamTarget:
    """Dump straight into an image store (``DumpTarget`` with ``stream = True``).

    >>> target = StreamTarget("s3://bucket/images", level=1, settings=s)  # doctest: +SKIP
    >>> result = await engine.freeze(job, target, mode)             # doctest: +SKIP
    >>> target.manifest.image_id                                    # doctest: +SKIP
    """

    stream = True

    def __init__(
        self,
        store_url: str | ImageStore,
        *,
        image_id: str | None = None,
        level: int | None = None,
        work_root: Path | None = None,
        piece_bytes: int | None = None,
        buffer_bytes: int = 256 * MiB,
        timeline: Timeline | None = None,
        writer_options: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
        finish_timeout: float | None = None,
        settings: ImageSettings,
    ) -> None:
        self.store_url = store_url
        self.settings = settings
        self.meta = dict(meta or {})
        self.finish_timeout = finish_timeout
        self.image_id = image_id
        self.level = level
        self.work_root = work_root
        self.piece_bytes = piece_bytes
        self.buffer_bytes = buffer_bytes
        self.timeline = timeline
        self.timeline_steps: list[Step] = []
        self.writer_options = dict(writer_options or {})
        self.manifest: Manifest | None = None
        self.capture_stats: CaptureStats | None = None
        self.writer_stats: TransferStats | None = None  # the chunk pipeline's, once committed
        self.capture_error: BaseException | None = None
        self.plan: StagingPlan | None = None
        self._work: Path | None = None
        self._writer: ImageWriter | None = None
        self._url: str | None = None
        self._sink: ImageSink | None = None
        self._capture: Capture | None = None
        self._pages_hold = 0
        self._pages_in_pieces = False
        self._t0 = 0.0

    @property
    def images_dir(self) -> Path:
        if self._work is None:
            raise StreamError("StreamTarget used before start()")
        return self._work / "criu"

    @property
    def extras_dir(self) -> Path:
        if self._work is None:
            raise StreamError("StreamTarget used before start()")
        return self._work / "extras"

    @property
    def url(self) -> str | None:
        """The image URL (known once opened, kept after the writer closed; the image is
        complete only after finish)."""
        return self._url

    async def open(self, job: str) -> str:
        """Open the image in the store (the writer's first write) and return its URL.

        Called before the engine touches the job, so that a store refusing the image fails
        here with the job untouched (the caller may then stage instead); :meth:`start` opens
        it when this was not called. :meth:`abort` closes it again."""
        from spotguard.image.writer import ImageWriter

        if self._writer is not None:
            return self._writer.url
        opts = dict(self.writer_options)
        if self.level is not None:
            opts["level"] = self.level
        opts.setdefault("settings", self.settings)
        writer = ImageWriter(self.store_url, job, self.image_id, **opts)
        await writer.__aenter__()
        self._writer = writer
        self._url = writer.url
        return writer.url

    async def start(self, job: str, need_bytes: int, hold: Hold | None = None) -> StagingPlan:
        """Open the image writer (unless :meth:`open` did) and listen on the capture socket
        (before CRIU starts). ``hold``: bytes kept in host memory beyond the usual bound
        while the store catches up (a leave-running dump: the job goes on once its image is
        copied out, :mod:`spotguard.checkpoint.hold`)."""
        from spotguard.checkpoint.hold import NO_HOLD
        from spotguard.checkpoint.staging import StagingPlan

        hold = hold or NO_HOLD
        self._t0 = time.time()
        await self.open(job)
        assert self._writer is not None
        writer = self._writer
        self._work = workdir(self.work_root, "sg-dump-")
        self.images_dir.mkdir()
        self.extras_dir.mkdir()
        self._sink = ImageSink(writer)
        # Pieces of one chunk each are handed to the writer as they are (no copy); enough of
        # them that every compressing thread has one while the readers fill the next.
        piece = self.piece_bytes or writer.chunk_size
        # the GPU memory's copy into the same pieces, made before the freeze (see Hold)
        self._pages_in_pieces = hold.prefault_pages > 0 and piece == writer.chunk_size
        room = hold.files + (hold.pages if self._pages_in_pieces else 0)
        self._capture = Capture(
            self.images_dir,
            self._sink,
            piece_bytes=piece,
            buffer_bytes=max(self.buffer_bytes, (writer.input_limit + 2) * piece) + room,
            pipe_bytes=pipe_bytes(self.settings),
        )
        writer.hold(hold.files, 0)
        if hold.pack_later and hold.total > 0:
            writer.deferral.close()  # opened by finish: the job runs again by then
        self._pages_hold = hold.pages  # granted part by part, as the GPU memory's size is known
        await self._capture.start()
        ahead = hold.prefault + (hold.prefault_pages if self._pages_in_pieces else 0)
        if ahead > 0:  # the job still runs: fault in its image's room now
            t = time.time()
            made = await self._capture.prefault(ahead, os.cpu_count() or 1)
            _step(self.timeline_steps, self.timeline, "hold_prefault", t, time.time(), bytes=made)
        inflight = writer.max_inflight * writer.chunk_size
        self.plan = StagingPlan(
            "stream",
            writer.url,
            need_bytes,
            0,
            f"streamed to the store; at most {inflight >> 20} MiB of chunks in flight",
            hold_bytes=hold.total,
        )
        log.info(
            "streaming image",
            extra={
                "image": writer.url,
                "need_bytes": need_bytes,
                "zstd_level": writer.level,
                "hold_bytes": hold.total,
            },
        )
        return self.plan

    async def drain(self) -> None:
        """CRIU wrote the image and waits, the tree frozen, in post-dump: every byte it
        wrote is taken out of its pipes before a leave-running job goes on (see
        ``DumpTarget.drain``), within ``finish_timeout`` seconds."""
        assert self._capture is not None
        try:
            self.capture_stats = await asyncio.wait_for(self._capture.settle(), self.finish_timeout)
        except TimeoutError as exc:
            await self.abort()
            raise StreamError(
                f"the streamed image was not read within {self.finish_timeout:.0f} s "
                "(store too slow or unreachable); no manifest written"
            ) from exc

    async def put_pages(self, name: str, size: int, fill: PageFill) -> None:
        """A file of the image whose chunk buffers ``fill`` writes straight into; its chunks
        are hashed, compressed and stored in the writer's pipeline like CRIU's files."""
        from spotguard.checkpoint.cpupages import PREFIX as CPU_PREFIX
        from spotguard.checkpoint.gpupages import check_part_name
        from spotguard.checkpoint.hold import spare

        if self._writer is None or self._sink is None:
            raise StreamError("StreamTarget used before start()")
        sink = self._writer.file(check_part_name(name), mode=0o600)
        pieces = self._capture.pieces if self._capture is not None else None
        whole = pieces is not None and pieces.size == self._writer.chunk_size
        if name.startswith(CPU_PREFIX + "-") and pieces is not None and whole:
            # the job's own memory: into the pieces CRIU's pipes are read into, held and
            # faulted in as theirs are (its share of the hold is CRIU's, ``files``)
            await sink.produce_owned(size, fill, pieces)
            return
        sink.raw_saving = self.settings.gpu_raw_saving
        if self._pages_in_pieces and pieces is not None:  # (their size: a chunk's)
            # a held pause's GPU memory: into pieces made before the freeze (their pool has
            # room for the whole hold, taken already: no second look at the host's memory)
            grant = min(self._pages_hold, size)
            self._pages_hold -= grant
            self._writer.hold(grant, 0)
            await sink.produce_owned(size, fill, pieces)
            return
        # A leave-running dump: this part is copied without waiting for the store, within
        # what the host can spare now that the staging exists (held twice at most).
        grant = min(self._pages_hold, size)
        self._pages_hold -= grant  # taken before the wait: parts are put at once
        if grant > 0:
            room = await asyncio.to_thread(spare) // 2
            self._pages_hold += max(0, grant - room)
            grant = min(grant, room)
        if grant > 0:
            self._writer.hold(grant, grant)
        await sink.produce(size, fill)

    async def finish(self, meta: ImageMeta) -> None:
        """CRIU wrote the image (it waits frozen in post-dump, or exited 0): wait for the last
        pieces, add the extras, commit the manifest — within ``finish_timeout`` seconds (a
        store that stops answering must not hold a frozen job or the caller forever).

        The manifest's ``meta`` is the caller's ``meta`` (instance facts, notice, plan ...)
        with the engine's image metadata over it, plus ``frozen_at`` and ``stream``: the
        same keys a staged image's manifest carries."""
        try:
            await asyncio.wait_for(self._finish(meta), self.finish_timeout)
        except TimeoutError as exc:
            await self.abort()
            raise StreamError(
                f"the streamed image was not durable within {self.finish_timeout:.0f} s "
                "(store too slow or unreachable); no manifest written"
            ) from exc

    async def _finish(self, meta: ImageMeta) -> None:
        assert self._capture is not None and self._writer is not None and self._sink is not None
        frozen_at = datetime.now(UTC).isoformat()
        self._writer.deferral.open()
        try:
            stats = await self._capture.settle()
            self.capture_stats = stats
            if not stats.files:
                raise StreamError("criu finished but streamed no image files")
            extras = _walk(self.extras_dir)
            names = {n for _, n in extras}
            clash = names & set(self._sink.names)
            if clash:
                raise StreamError(f"extra files clash with CRIU's image files: {sorted(clash)}")
            meta.write(self.extras_dir)
            for path, name in _walk(self.extras_dir):
                await self._writer.add_file(path, name)
            t_commit = time.time()
            body = {"frozen_at": frozen_at, **self.meta, **meta.to_json()}
            body[STREAM_KEY] = {
                "criu_files": self._sink.names,
                "renames": self._sink.renames,
                "extras": [n for _, n in _walk(self.extras_dir)],
                "capture": stats.to_json(),
            }
            self.manifest = await self._writer.commit(body)
            self.writer_stats = self._writer.stats
            done = time.time()
            url = self._writer.url
        except BaseException:
            await self.abort()
            raise
        steps, tl = self.timeline_steps, self.timeline
        _step(steps, tl, "stream_capture", stats.started, stats.finished or done, **stats.to_json())
        _step(self.timeline_steps, self.timeline, "image_commit", t_commit, done, image=url)
        _step(self.timeline_steps, self.timeline, "stream_durable", self._t0, done, image=url)
        log.info(
            "image durable",
            extra={"image": url, "seconds": round(done - self._t0, 3),
                   "bytes": stats.bytes, "peak_buffered": stats.peak_buffered,
                   "pipe_bytes": stats.pipe_bytes,
                   "chunks_deferred": self.writer_stats.chunks_deferred if self.writer_stats
                   else 0},
        )  # fmt: skip
        await self._close(None)

    async def abort(self) -> None:
        """The dump failed or was cancelled: close CRIU's pipes, write no manifest.
        ``capture_error`` keeps why the capture stopped, when it did first (a store that
        refused a chunk makes CRIU fail with EPIPE: the store's error is the cause)."""
        if self._capture is not None:
            self.capture_error = self.capture_error or self._capture.error
            await self._capture.abort()
        await self._close(StreamError("dump aborted"))

    async def _close(self, exc: BaseException | None) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with contextlib.suppress(Exception):
                await writer.__aexit__(type(exc) if exc else None, exc, None)
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)


def pipe_bytes(settings: ImageSettings) -> int:
    """The pipe size a stream asks for (``pipe_mb``), after raising the kernel's limit to it
    where it is lower (:func:`spotguard.stream.pipes.ensure_pipe_max`)."""
    want = settings.pipe_mb * MiB
    pipes.ensure_pipe_max(want)
    return want
