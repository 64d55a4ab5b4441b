"""Google Cloud Storage store: ``gs://bucket[/prefix]``.

google-cloud-storage directly. ``if_absent`` writes carry the generation precondition
``ifGenerationMatch=0`` ("only if no live object has this name"), so a manifest is never
overwritten by accident; the server refuses with 412. The library's own retries are switched
off (``retry=None``) so that the one retry policy of :class:`BlockingStore` applies. The
endpoint comes from ``STORAGE_EMULATOR_HOST`` when set (then anonymous credentials are used),
which is how the tests run against fake-gcs-server.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import UTC
from typing import Any

from spotguard.errors import ObjectNotFound, PreconditionFailed, StoreError, StoreUnavailable
from spotguard.store.base import BlockingStore, Data, ObjectInfo, RetryPolicy

#: HTTP answers that say the bucket is full or the object too large: not retried.
_FULL_STATUS = frozenset({413, 507})


class GcsStore(BlockingStore):
    """Objects under ``gs://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        io_workers: int = 16,
        retry: RetryPolicy | None = None,
        project: str | None = None,
    ) -> None:
        self.bucket_name = bucket
        self.prefix = prefix.strip("/")
        url = f"gs://{bucket}/{self.prefix}" if self.prefix else f"gs://{bucket}"
        super().__init__(url, io_workers=io_workers, retry=retry)
        self.project = project
        self._local = threading.local()

    @property
    def bucket(self) -> Any:
        """A ``storage.Bucket`` for the calling thread (clients are made per thread, lazily)."""
        b = getattr(self._local, "bucket", None)
        if b is None:
            import google.cloud.storage as storage

            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(
                    project=self.project or "spotguard-local",
                    credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
                )
            else:
                client = storage.Client(project=self.project)
            b = client.bucket(self.bucket_name)
            self._local.bucket = b
        return b

    @property
    def _timeout(self) -> tuple[float, float]:
        """(connect, read) seconds for one request: see :attr:`RetryPolicy.timeout`."""
        return (min(10.0, self.retry.timeout), self.retry.timeout)

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _unk(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _put(self, key: str, data: Data, if_absent: bool) -> None:
        blob = self.bucket.blob(self._k(key))
        kwargs: dict[str, Any] = {"retry": None, "checksum": "crc32c", "timeout": self._timeout}
        if if_absent:
            kwargs["if_generation_match"] = 0
        if not isinstance(data, bytes):
            data = bytes(data)  # the client wants bytes (it keeps no reference after)
        blob.upload_from_string(data, content_type="application/octet-stream", **kwargs)

    def _get(self, key: str) -> bytes:
        blob = self.bucket.blob(self._k(key))
        data: bytes = blob.download_as_bytes(retry=None, checksum="crc32c", timeout=self._timeout)
        return data

    def _get_capped(self, key: str, limit: int) -> bytes:
        info = self._stat(key)
        if info is None:
            return self._get(key)  # raises the backend's not-found, mapped as usual
        if info.size == 0:
            return b""
        # a ranged read: never more than limit + 1 bytes, even if the object grew meanwhile
        blob = self.bucket.blob(self._k(key))
        data: bytes = blob.download_as_bytes(
            start=0, end=limit, retry=None, checksum=None, timeout=self._timeout
        )
        return data

    def _stat(self, key: str) -> ObjectInfo | None:
        blob = self.bucket.get_blob(self._k(key), retry=None, timeout=self._timeout)
        if blob is None:
            return None
        return ObjectInfo(key, int(blob.size or 0), blob.updated.astimezone(UTC))

    def _list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        for blob in self.bucket.client.list_blobs(
            self.bucket_name, prefix=self._k(prefix), retry=None, timeout=self._timeout
        ):
            out.append(
                ObjectInfo(self._unk(blob.name), int(blob.size or 0), blob.updated.astimezone(UTC))
            )
        return out

    def _list_dirs(self, prefix: str) -> list[str]:
        full = self._k(prefix)
        if full and not full.endswith("/"):
            full += "/"
        it = self.bucket.client.list_blobs(
            self.bucket_name, prefix=full, delimiter="/", retry=None, timeout=self._timeout
        )
        for _page in it.pages:
            pass  # prefixes are collected while paging
        return [p[len(full) :].rstrip("/") for p in it.prefixes]

    def _delete(self, key: str) -> None:
        from google.api_core.exceptions import NotFound

        with contextlib.suppress(NotFound):
            self.bucket.blob(self._k(key)).delete(retry=None, timeout=self._timeout)

    def _map_error(self, exc: Exception, key: str) -> StoreError | None:
        from google.api_core import exceptions as gexc
        from google.auth.exceptions import DefaultCredentialsError, TransportError
        from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
        from requests.exceptions import RequestException

        where = f"{self.url}/{key}"
        if isinstance(exc, gexc.NotFound):
            if "bucket" in str(exc).lower() and "object" not in str(exc).lower():
                return StoreError(f"bucket {self.bucket_name!r} does not exist ({self.url})")
            return ObjectNotFound(f"{where} does not exist")
        if isinstance(exc, gexc.PreconditionFailed):
            return PreconditionFailed(f"{where} already exists")
        if getattr(exc, "code", None) in _FULL_STATUS:
            return StoreError(f"{where}: no room in the store: {exc}")
        if isinstance(
            exc,
            gexc.TooManyRequests
            | gexc.ServerError
            | gexc.RetryError
            | TransportError
            | RequestException  # refused, timed out, cut short (a truncated JSON answer too)
            | DataCorruption,
        ):
            return StoreUnavailable(f"{where}: {exc}")
        if isinstance(exc, InvalidResponse):
            status = getattr(exc.response, "status_code", 0)
            if status == 404:
                return ObjectNotFound(f"{where} does not exist")
            if status == 412:
                return PreconditionFailed(f"{where} already exists")
            if status in _FULL_STATUS:
                return StoreError(f"{where}: no room in the store: HTTP {status}")
            if status == 429 or status >= 500:
                return StoreUnavailable(f"{where}: HTTP {status}")
            return StoreError(f"{where}: HTTP {status}")
        if isinstance(exc, DefaultCredentialsError):
            return StoreError(f"{self.url}: no Google credentials found ({exc})")
        if isinstance(exc, gexc.GoogleAPICallError):
            return StoreError(f"{where}: {exc.message}")
        return None
