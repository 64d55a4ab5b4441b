"""Transfer counters shared by writers, readers and the CLI's progress bars."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20


@dataclass
class TransferStats:
    """Bytes and chunks moved so far by one transfer.

    ``bytes`` counts plaintext bytes handled (uploaded *or* skipped); ``stored_bytes`` what
    actually crossed the wire (compressed, encrypted); ``bytes_skipped`` plaintext bytes whose
    chunks were already in the store (dedup) or repeated within the image.
    """

    phase: str = "upload"
    total: int | None = None
    bytes: int = 0
    stored_bytes: int = 0
    bytes_skipped: int = 0
    stored_bytes_skipped: int = 0
    chunks: int = 0
    chunks_skipped: int = 0
    chunks_raw: int = 0  # stored as raw frames: a sample showed they do not compress
    chunks_deferred: int = 0  # kept raw while a held image's job was frozen (Deferral)
    retries: int = 0
    #: buffers the writer's pool made over the transfer (fresh memory, its pages faulted in
    #: as first written): a held pause's copies go into room made before the freeze instead
    buffers_made: int = 0
    # seconds spent per step of the chunk pipeline, summed over chunks (a sum above the
    # transfer's own seconds means that step ran for several chunks at once): where the
    # pipeline waits — for a slot, a buffer, the CPU work or the store
    step_seconds: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @property
    def seconds(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def rate(self) -> float:
        """Plaintext bytes per second (what the job's image size moves at)."""
        s = self.seconds
        return self.bytes / s if s > 0 else 0.0

    @property
    def wire_rate(self) -> float:
        """Stored bytes per second (what the network carries)."""
        s = self.seconds
        return self.stored_bytes / s if s > 0 else 0.0

    def count_chunk(
        self, size: int, stored: int, *, skipped: int | None = None, raw: bool = False
    ) -> None:
        """One chunk of ``size`` plaintext bytes written as ``stored`` bytes (a raw frame
        where ``raw``), or found stored already as ``skipped`` bytes."""
        self.bytes += size
        self.chunks += 1
        self.chunks_raw += raw
        self.stored_bytes += stored
        if skipped is not None:
            self.bytes_skipped += size
            self.stored_bytes_skipped += skipped
            self.chunks_skipped += 1

    def add_step(self, step: str, since: float) -> None:
        """Count the seconds from ``since`` (``time.perf_counter()``) into ``step``."""
        self.add_seconds(step, time.perf_counter() - since)

    def add_seconds(self, step: str, seconds: float) -> None:
        """Count ``seconds`` into ``step``."""
        self.step_seconds[step] = self.step_seconds.get(step, 0.0) + seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "bytes": self.bytes,
            "total": self.total,
            "stored_bytes": self.stored_bytes,
            "bytes_skipped": self.bytes_skipped,
            "stored_bytes_skipped": self.stored_bytes_skipped,
            "chunks": self.chunks,
            "chunks_skipped": self.chunks_skipped,
            "chunks_raw": self.chunks_raw,
            "chunks_deferred": self.chunks_deferred,
            "retries": self.retries,
            "buffers_made": self.buffers_made,
            "seconds": round(self.seconds, 3),
            "mb_s": round(self.rate / MIB, 1),
            "wire_mb_s": round(self.wire_rate / MIB, 1),
            "step_seconds": {k: round(v, 3) for k, v in self.step_seconds.items()},
        }


#: Called after every chunk with the running counters (on the event loop; keep it cheap).
ProgressFn = Callable[[TransferStats], None]
