"""The one protocol every object-store backend implements, and the shared machinery.

A store is a flat key → bytes namespace under a URL (``file:///srv/images``, ``s3://bucket/pfx``,
``gs://bucket/pfx``). Keys are ``/``-separated and relative to that URL; the image layer
(:mod:`spotguard.image`) decides what the keys are (see :mod:`spotguard.contracts`).

Backends talk to blocking SDKs, so :class:`BlockingStore` runs each call in a thread pool, maps
the SDK's errors to :mod:`spotguard.errors` in ONE method per backend (``_map_error``), and
retries :class:`~spotguard.errors.StoreUnavailable` with exponential backoff and jitter
(:func:`spotguard.retry.call`). Everything above the store sees only ``StoreUnavailable`` (after
the retries ran out), ``ObjectNotFound``, ``PreconditionFailed`` and, for what retrying cannot
fix (a full disk or bucket, permissions, a malformed answer), a plain ``StoreError``, never
retried. A request that hangs is bounded by :attr:`RetryPolicy.timeout`. docs/operations.md
("Fault table") lists each store fault, what the store does about it and the test that proves
it.

Data goes in as any bytes-like object (a view of a reused buffer, usually) and a store must not
keep a reference to it once ``put`` returns. :func:`get_into` reads an object into a caller's
buffer where the backend can (file, S3), so a restore reuses its buffers too.

Durability: an acknowledged ``put(..., if_absent=True)`` is durable. A plain ``put`` is atomic
(never seen half-written) but may be durable only after :meth:`ImageStore.sync` of its key: an
S3 or GCS PUT is durable when acknowledged, so their ``sync`` does nothing, while the file store
defers its fsyncs to ``sync`` so that one image's chunks reach the disk in one batch.
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, TypeVar, runtime_checkable

from spotguard import retry as retries
from spotguard.errors import StoreError, StoreUnavailable
from spotguard.retry import RetryPolicy as RetryPolicy  # re-exported: the stores' settings

log = logging.getLogger(__name__)

T = TypeVar("T")

Data = bytes | bytearray | memoryview
"""What ``put`` accepts: any contiguous bytes-like object, never kept after the call."""

PartsRead = Callable[[int, int], None]
"""Told ``(i, j)`` by :meth:`BlockingStore.get_parts` once ``parts[i:j]`` are filled."""

Parts = Sequence[Data] | Callable[[], Sequence[Data]]
"""What :meth:`BlockingStore.put_parts` writes: the buffers, or a call that makes them in the
store's thread (a raw chunk's ~1,000 views: made in the event loop they held it and the GIL)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key (relative to the store URL), size and last change."""

    key: str
    size: int
    modified: datetime


@runtime_checkable
class ImageStore(Protocol):
    """Object storage for images. All methods are coroutines; keys never start with ``/``.

    ``put(..., if_absent=True)`` is the atomic commit primitive: it raises
    :class:`~spotguard.errors.PreconditionFailed` when the key already exists, and no reader
    ever sees a partially written object. ``sync(keys)`` makes plain puts of ``keys`` durable
    (:class:`~spotguard.errors.ObjectNotFound` when one is absent); a commit calls it for every
    object the commit refers to before it writes the commit record.
    """

    url: str

    async def put(self, key: str, data: Data, *, if_absent: bool = False) -> None: ...

    async def get(self, key: str) -> bytes: ...

    async def stat(self, key: str) -> ObjectInfo | None: ...

    async def exists(self, key: str) -> bool: ...

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]: ...

    async def list_dirs(self, prefix: str) -> builtins.list[str]: ...

    async def delete(self, key: str) -> None: ...

    async def sync(self, keys: Sequence[str]) -> None: ...

    async def aclose(self) -> None: ...


class BlockingStore(ABC):
    """Base for backends built on blocking SDK calls.

    Subclasses implement the ``_put/_get/_stat/_list/_list_dirs/_delete`` methods (blocking,
    run in this store's thread pool) and ``_map_error`` (SDK exception → spotguard error).
    """

    url: str
    #: Whether :meth:`put_parts` writes the buffers without joining them first.
    writes_parts: bool = False
    #: Whether :meth:`get_parts` reads straight into the parts (no whole-object buffer).
    reads_parts: bool = False

    def __init__(self, url: str, *, io_workers: int = 16, retry: RetryPolicy | None = None) -> None:
        self.url = url.rstrip("/")
        self.io_workers = io_workers
        self.retry = retry or RetryPolicy()
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="store-io")
        self.retries = 0  # transient failures retried so far (reported by transfers)

    # --- to implement -------------------------------------------------------------------
    @abstractmethod
    def _put(self, key: str, data: Data, if_absent: bool) -> None:
        """Write ``data`` at ``key`` (``if_absent``: refuse an existing object)."""

    def _put_parts(self, key: str, parts: Sequence[Data], if_absent: bool) -> None:
        self._put(key, b"".join(parts), if_absent)

    @abstractmethod
    def _get(self, key: str) -> bytes:
        """The object's bytes."""

    def _get_into(self, key: str, buf: memoryview) -> memoryview:
        """The object's bytes in ``buf`` when they fit; backends that can read into a buffer
        override this, the others hand back a view of fresh bytes."""
        return memoryview(self._get(key))

    def _get_capped(self, key: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of the object (more than ``limit`` tells the caller it
        is too large, without reading it whole); the backends override this with a bounded
        read, this fallback reads it whole."""
        return self._get(key)[: limit + 1]

    @abstractmethod
    def _stat(self, key: str) -> ObjectInfo | None:
        """The object's size and time, or None when there is none."""

    @abstractmethod
    def _list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix``."""

    @abstractmethod
    def _list_dirs(self, prefix: str) -> list[str]:
        """The next path segments under ``prefix`` (its "directories")."""

    @abstractmethod
    def _delete(self, key: str) -> None:
        """Remove the object (none there is not an error)."""

    @abstractmethod
    def _map_error(self, exc: Exception, key: str) -> StoreError | None:
        """The spotguard error for an SDK exception, or None to let it propagate."""

    # --- machinery ----------------------------------------------------------------------
    def _mapped(self, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` with its SDK errors mapped to spotguard's (in whichever thread runs it)."""
        try:
            return fn()
        except StoreError:
            raise
        except Exception as exc:
            mapped = self._map_error(exc, key)
            if mapped is None:
                raise
            raise mapped from exc

    def _logged(self, what: str, key: str) -> Callable[[retries.Retry], None]:
        def logged(r: retries.Retry) -> None:
            self.retries += 1
            log.warning(
                "store call failed, retrying",
                extra={"op": what, "key": key, "attempt": r.attempt, "error": str(r.error)},
            )

        return logged

    async def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` in the pool; map its errors; retry transient ones with backoff."""
        loop = asyncio.get_running_loop()

        async def once() -> T:
            return await loop.run_in_executor(self._pool, self._mapped, key, fn)

        return await retries.call(
            once, self.retry, StoreUnavailable, on_retry=self._logged(what, key)
        )

    def _call_here(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """:meth:`_call` in the caller's thread (blocking): the same error mapping, retries
        and backoff, for a worker that has the data in hand (see
        :meth:`put_parts_unless_stored_now`)."""
        return retries.call_blocking(
            lambda: self._mapped(key, fn),
            self.retry,
            StoreUnavailable,
            on_retry=self._logged(what, key),
        )

    async def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        """Write ``data`` at ``key`` atomically (``if_absent``: only if nothing is there)."""
        await self._call("put", key, lambda: self._put(key, data, if_absent))

    async def put_parts(self, key: str, parts: Parts, *, if_absent: bool = False) -> None:
        """Like :meth:`put` of the concatenation of ``parts`` (or of what ``parts()`` returns,
        called in the store's thread). Stores that can write a list of buffers at once say so
        with ``writes_parts``; the others join them here (a copy)."""

        def put() -> None:
            self._put_parts(key, parts() if callable(parts) else parts, if_absent)

        await self._call("put", key, put)

    def put_parts_unless_stored_now(self, key: str, parts: Parts) -> ObjectInfo | None:
        """:meth:`stat`, then — only where nothing is stored at ``key`` — :meth:`put_parts`,
        blocking, in the caller's thread, with the store's error mapping and retries: the
        object found (nothing written), or None once written. A writer's thread that has
        just copied in and addressed a chunk looks it up and stores it with no trip through
        the event loop."""
        return self._call_here("put", key, functools.partial(self._stat_or_put, key, parts))

    def _stat_or_put(self, key: str, parts: Parts) -> ObjectInfo | None:
        info = self._stat(key)
        if info is None:
            self._put_parts(key, parts() if callable(parts) else parts, False)
        return info

    async def get(self, key: str) -> bytes:
        """The object's bytes; :class:`ObjectNotFound` when absent."""
        return await self._call("get", key, lambda: self._get(key))

    async def get_capped(self, key: str, limit: int) -> bytes:
        """The object's bytes, at most ``limit + 1`` of them (never more in memory): an object
        in a store anyone may write is read with a cap (manifests, chunks)."""
        return await self._call("get", key, lambda: self._get_capped(key, limit))

    async def get_into(self, key: str, buf: memoryview) -> memoryview:
        """The object's bytes, read into ``buf`` (a view of it) when they fit; an object
        larger than ``buf`` (or of unknown length that does not fit) gives ``len(buf) + 1`` new
        bytes, never the whole object: more than fits tells the caller it is not what it
        expected (a chunk is read into a buffer of its largest stored size).
        :class:`ObjectNotFound` when absent."""
        return await self._call("get", key, lambda: self._get_into(key, buf))

    async def get_parts(self, key: str, parts: Sequence[memoryview], after: PartsRead) -> int:
        """Read an object of exactly ``sum(len(p) for p in parts)`` bytes into ``parts`` in
        order, calling ``after(i, j)`` (in the store's thread) as soon as ``parts[i:j]`` are
        filled — a caller hashes what was just read while it is in cache. Returns the object's
        size: any other size than the parts' total means they were not (all) filled.
        Stores with ``reads_parts`` read straight into the parts; the others read the object
        whole first. :class:`ObjectNotFound` when absent."""
        return await self._call("get", key, lambda: self._get_parts(key, parts, after))

    async def run_get(self, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` — a read of ``key`` through :meth:`read_parts` and what the caller does
        with the bytes right after — in the store's thread, with the store's error mapping
        and retries (``fn`` runs again after a transient failure, so it must start over
        cleanly): a restore reads, checks and writes back each chunk in the one thread
        (:mod:`spotguard.image.inplace`), with no hop through the event loop between."""
        return await self._call("get", key, fn)

    def read_parts(self, key: str, parts: Sequence[memoryview], after: PartsRead) -> int:
        """:meth:`get_parts`, blocking: for a ``fn`` given to :meth:`run_get`."""
        return self._get_parts(key, parts, after)

    def _get_parts(self, key: str, parts: Sequence[memoryview], after: PartsRead) -> int:
        """The general way (a store without ``reads_parts``): the whole object, then copied
        into the parts — correct everywhere, the reading in place is the file store's."""
        data = memoryview(self._get(key))
        if len(data) != sum(len(p) for p in parts):
            return len(data)
        pos = 0
        for i, part in enumerate(parts):
            part[:] = data[pos : pos + len(part)]
            pos += len(part)
            after(i, i + 1)
        return len(data)

    async def stat(self, key: str) -> ObjectInfo | None:
        """Size and change time of ``key``, or None when absent."""
        return await self._call("stat", key, lambda: self._stat(key))

    async def exists(self, key: str) -> bool:
        return await self.stat(key) is not None

    async def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (recursively), sorted by key."""
        items = await self._call("list", prefix, lambda: self._list(prefix))
        return sorted(items, key=lambda i: i.key)

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        """Names of the "directories" directly below ``prefix`` (which ends with ``/`` or is
        empty), sorted."""
        return sorted(await self._call("list_dirs", prefix, lambda: self._list_dirs(prefix)))

    async def delete(self, key: str) -> None:
        """Remove ``key``; removing an absent key is not an error."""
        await self._call("delete", key, lambda: self._delete(key))

    async def sync(self, keys: Sequence[str]) -> None:
        """Make the objects at ``keys`` durable. Backends whose acknowledged writes are
        already durable (S3, GCS) keep this no-op; the file store fsyncs here."""
        return None

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> BlockingStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


async def get_capped(store: ImageStore, key: str, limit: int) -> bytes:
    """``store.get_capped`` where the store has it (every :class:`BlockingStore`), else
    ``store.get`` cut to ``limit + 1`` bytes: more than ``limit`` means too large."""
    method = getattr(store, "get_capped", None)
    if method is not None:
        data: bytes = await method(key, limit)
        return data
    return (await store.get(key))[: limit + 1]


async def get_into(store: ImageStore, key: str, buf: memoryview) -> memoryview:
    """``store.get_into`` where the store has it (every :class:`BlockingStore`), else a view of
    ``store.get``: stores outside this package need only the protocol."""
    method = getattr(store, "get_into", None)
    if method is not None:
        view: memoryview = await method(key, buf)
        return view
    return memoryview(await store.get(key))
