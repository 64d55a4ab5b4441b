"""A chunk read into its buffer, checked and used in one worker thread.

A restore writes each verified chunk of the memory carried beside CRIU back into the
restored job. Read in one thread (the store's), handed back through the event loop and
written by another, every chunk crossed two threads and the loop: on a 16-core host
restoring eight ranks, ~10 cores were busy where the bare work kept 16 so (docs/benchmarks.md,
"Raw chunks through the file store"). Here the store reads the chunk's blocks into place
(:class:`~spotguard.image.rawframe.RawReadPlan`), hashing them as they land, and in the same
thread the layout and the hash are checked and — only then — the caller's ``then`` gets the
verified bytes: a chunk is read, verified and written back by the one thread that has it in
cache, as the floor does (``bench.floor``). A chunk that is not raw is decoded and checked
(:func:`decode`), an all-zero one zeroed where its buffer is not fresh (:func:`zero`), and
``then`` called in that same worker thread.

Nothing the job gets is unverified: ``then`` runs only after the hash matched the chunk's
authenticated address. Its errors (the job's process gone) are carried out of the store's
thread and raised as they are, never taken for the store's (which would be retried).
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass

from spotguard.errors import ImageCorrupt
from spotguard.image import memops
from spotguard.image.buffers import OwnedChunk
from spotguard.image.codec import ChunkCodec
from spotguard.image.manifest import ChunkRef
from spotguard.image.rawframe import RawReadPlan
from spotguard.store.base import BlockingStore

#: what a reader does with a chunk's verified bytes (a view of exactly its size), in a thread
Then = Callable[[memoryview], None]


@dataclass
class RawRead:
    """What one read in place came to."""

    stored: int = 0  # bytes read from the store
    raw: bool = False  # the object was the writer's raw layout (else: decode it the general way)
    matched: bool = False  # its hash matched the chunk's address
    then_s: float = 0.0  # seconds in ``then``
    error: BaseException | None = None  # raised by ``then``


async def read_raw(
    store: BlockingStore,
    key: str,
    ref: ChunkRef,
    out: memoryview,
    codec: ChunkCodec,
    then: Then | None = None,
) -> RawRead:
    """Read the raw chunk ``ref`` at ``key`` into ``out`` (at least ``ref.size`` bytes),
    check its layout and hash and, when both hold, call ``then`` with the verified bytes —
    the plan of the read made, the read, the checks and ``then`` all in the store's thread
    (the plan's ~1,000 views, made in the event loop, held it). :class:`ImageCorrupt` when
    the hash does not match; a result with ``raw`` False when the object is not the writer's
    raw layout (the caller decodes it); ``then``'s error raised as it is."""

    def work() -> RawRead:  # in the store's thread; raises only the store's own errors
        res = RawRead()
        plan = RawReadPlan(ref.size, out, codec)
        try:
            res.stored = store.read_parts(key, plan.parts, plan.after)
            res.raw = res.stored == plan.total and plan.layout_ok()
            if res.raw:
                res.matched = hmac.compare_digest(plan.hexdigest(), ref.digest)
        finally:
            plan.release()
        if res.matched and then is not None:
            t0 = time.perf_counter()
            try:
                with out[: ref.size] as view:
                    then(view)
            except BaseException as exc:  # noqa: BLE001 - carried out of the thread, raised below
                res.error = exc
            res.then_s = time.perf_counter() - t0
        return res

    res = await store.run_get(key, work)
    if res.error is not None:
        raise res.error
    if res.raw and not res.matched:
        raise ImageCorrupt(f"chunk {ref.digest} fails its hash check", chunk=ref.digest)
    return res


def zero(out: OwnedChunk, then: Then | None) -> None:
    """Zero a reused buffer's first ``out.size`` bytes (a fresh map reads zero already), then
    hand them to ``then``."""
    with memoryview(out.map) as whole, whole[: out.size] as view:
        if not out.fresh:
            memops.zero(view)
        if then is not None:
            then(view)


def decode(
    codec: ChunkCodec, stored: memoryview, ref: ChunkRef, out: OwnedChunk, then: Then | None
) -> float:
    """Decode and check ``stored`` into ``out``, then hand the verified bytes to ``then``;
    the seconds ``then`` took."""
    codec.decode_into(stored, ref.digest, ref.size, out.map).release()
    if then is None:
        return 0.0
    t0 = time.perf_counter()
    with memoryview(out.map) as whole, whole[: ref.size] as view:
        then(view)
    return time.perf_counter() - t0
