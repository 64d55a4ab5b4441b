"""Where the capture's pipe readers spend their time (a bench-only probe, no product change).

``Readers()`` wraps, for as long as it is entered, the three things a reader thread of
:mod:`spotguard.stream.capture` does besides its Python: ``os.readv`` out of CRIU's pipe,
``poll`` on an empty pipe, and :meth:`PiecePool.take` waiting for a free piece. For each it
sums wall seconds and the thread's CPU seconds over the call, so that

- readv wall - readv CPU is time the thread waited *after* its copy for the GIL (a
  non-blocking read never sleeps in the kernel; what it waits for on return is the lock),
- take wall is time waited for a piece (the pipeline holds them all),
- poll wall is time waited for CRIU to write.

    with Readers() as r:
        ...           # a freeze
    print(r.summary())
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from spotguard.stream import pipes


@dataclass
class _Sums:
    reads: int = 0
    bytes: int = 0
    read_wall: float = 0.0
    read_cpu: float = 0.0
    polls: int = 0
    poll_wall: float = 0.0
    takes: int = 0
    take_wall: float = 0.0
    threads: set[int] = field(default_factory=set)


class _Os(ModuleType):
    """``os`` as :mod:`spotguard.stream.pipes` sees it, with ``readv`` timed."""

    def __init__(self, sums: _Sums, lock: threading.Lock) -> None:
        super().__init__("os")
        self._sums, self._lock = sums, lock

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def readv(self, fd: int, buffers: Any) -> int:
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            n = os.readv(fd, buffers)
        finally:
            w1, c1 = time.perf_counter(), time.thread_time()
            with self._lock:
                s = self._sums
                s.reads += 1
                s.read_wall += w1 - w0
                s.read_cpu += c1 - c0
                s.threads.add(threading.get_native_id())
        with self._lock:
            self._sums.bytes += n
        return n


class Readers:
    """Time the capture readers' reads, polls and piece waits while entered."""

    def __init__(self) -> None:
        self.sums = _Sums()
        self._lock = threading.Lock()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Readers:
        s, lock = self.sums, self._lock
        take = pipes.PiecePool.take
        poll_cls = pipes.select

        def timed_take(pool: pipes.PiecePool) -> Any:
            t0 = time.perf_counter()
            try:
                return take(pool)
            finally:
                with lock:
                    s.takes += 1
                    s.take_wall += time.perf_counter() - t0

        class _Poll:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def register(self, *a: Any) -> None:
                self._inner.register(*a)

            def poll(self, ms: int) -> Any:
                t0 = time.perf_counter()
                try:
                    return self._inner.poll(ms)
                finally:
                    with lock:
                        s.polls += 1
                        s.poll_wall += time.perf_counter() - t0

        class _Select(ModuleType):
            def __getattr__(self, name: str) -> Any:
                return getattr(poll_cls, name)

            def poll(self) -> _Poll:
                return _Poll(poll_cls.poll())

        self._patch(pipes.PiecePool, "take", timed_take)
        self._patch(pipes, "os", _Os(s, lock))
        self._patch(pipes, "select", _Select("select"))
        return self

    def _patch(self, obj: Any, name: str, value: Callable[..., Any] | ModuleType) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def __exit__(self, *exc: object) -> None:
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()

    def summary(self) -> dict[str, float | int]:
        s = self.sums
        return {
            "reader_threads": len(s.threads),
            "reads": s.reads,
            "mib_per_read": round(s.bytes / max(1, s.reads) / (1 << 20), 2),
            "read_cpu_s": round(s.read_cpu, 2),
            "read_wait_after_s": round(s.read_wall - s.read_cpu, 2),
            "polls": s.polls,
            "poll_s": round(s.poll_wall, 2),
            "takes": s.takes,
            "take_wait_s": round(s.take_wall, 2),
        }
