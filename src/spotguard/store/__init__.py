"""Object stores for checkpoint images, chosen by URL scheme.

======================  ===========================================================
URL                     backend
======================  ===========================================================
``/path``, ``file://``  :class:`~spotguard.store.file.FileStore` (atomic rename, fsync)
``s3://bucket/prefix``  :class:`~spotguard.store.s3.S3Store` (boto3, parallel multipart)
``gs://bucket/prefix``  :class:`~spotguard.store.gcs.GcsStore` (generation preconditions)
======================  ===========================================================

SDKs are imported only when a store of that kind is first used.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from spotguard.errors import ConfigError
from spotguard.extras import require_for_store
from spotguard.store.base import BlockingStore, Data, ImageStore, ObjectInfo, RetryPolicy, get_into

__all__ = [
    "URL_SCHEMES",
    "BlockingStore",
    "Data",
    "ImageStore",
    "ObjectInfo",
    "RetryPolicy",
    "get_into",
    "open_store",
]

#: the prefixes that make a destination a store URL rather than a plain directory path (the
#: one list, asked by park's ``--to`` and by the checkpoint operations)
URL_SCHEMES = ("s3://", "gs://", "file://")


def open_store(
    url: str,
    *,
    io_workers: int = 16,
    retry: RetryPolicy | None = None,
    sse: str | None = None,
    sse_kms_key_id: str | None = None,
) -> BlockingStore:
    """The store for ``url``: ``file:///dir`` or a plain path, ``s3://bucket[/prefix]``,
    ``gs://bucket[/prefix]``. ``sse``/``sse_kms_key_id`` apply to S3 only.

    Raises :class:`~spotguard.errors.ConfigError` for an unknown scheme or a URL without bucket.
    """
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file"):
        if scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {url!r} must be file:///absolute/path")
        path = unquote(parsed.path) if scheme == "file" else url
        if not path:
            raise ConfigError(f"store URL {url!r} names no directory")
        from spotguard.store.file import FileStore

        return FileStore(Path(path), io_workers=io_workers, retry=retry)
    if scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise ConfigError(f"store URL {url!r} names no bucket")
        prefix = parsed.path.strip("/")
        require_for_store(url)  # a clear MissingExtra, not "No module named 'botocore'"
        if scheme == "s3":
            from spotguard.store.s3 import S3Store

            return S3Store(
                parsed.netloc,
                prefix,
                io_workers=io_workers,
                retry=retry,
                sse=sse,
                sse_kms_key_id=sse_kms_key_id,
            )
        from spotguard.store.gcs import GcsStore

        return GcsStore(parsed.netloc, prefix, io_workers=io_workers, retry=retry)
    raise ConfigError(f"unsupported store URL {url!r}: use file://, a path, s3:// or gs://")
