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

import re
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
    "check_url",
    "get_into",
    "looks_like_url",
    "open_store",
]

#: the prefixes that make a destination a store URL rather than a plain directory path (the
#: one list, asked by park's ``--to`` and by the checkpoint operations)
URL_SCHEMES = ("s3://", "gs://", "file://")
#: ``scheme:/``: written as a URL (``s3:/bucket``, one slash short, is a URL mistyped, not a path)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/")
#: What a bucket name may hold at most (botocore's own check, which GCS names also meet): a
#: URL outside it is refused here, not by the SDK as several lines of regexes at exit 1
_BUCKET = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


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
    scheme, where, prefix = check_url(url)
    if scheme == "file":
        from spotguard.store.file import FileStore

        return FileStore(Path(where), io_workers=io_workers, retry=retry)
    require_for_store(url)  # a clear MissingExtra, not "No module named 'botocore'"
    if scheme == "s3":
        from spotguard.store.s3 import S3Store

        return S3Store(
            where,
            prefix,
            io_workers=io_workers,
            retry=retry,
            sse=sse,
            sse_kms_key_id=sse_kms_key_id,
        )
    from spotguard.store.gcs import GcsStore

    return GcsStore(where, prefix, io_workers=io_workers, retry=retry)


def looks_like_url(where: str) -> bool:
    """True for anything written as a URL (``scheme:/…``), whether or not spotguard has a
    store for its scheme: a destination so written is a store URL to check
    (:func:`check_url`), never a directory path named after a mistyped scheme."""
    return _URL.match(where) is not None


def check_url(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket or directory, prefix)`` of a store URL — ``file``, ``s3`` or ``gs``;
    a plain path is a ``file`` store — without opening it (no SDK, no credentials, no I/O):
    what callers ask before they touch a job, so bad input is refused first.

    Raises :class:`~spotguard.errors.ConfigError` for an unknown scheme, an ``s3``/``gs``
    URL without a bucket or with one no store can have, a ``file`` URL naming a host or no
    directory, or a URL with a query or a fragment.
    """
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if not looks_like_url(url):
        if not url:
            raise ConfigError("store URL '' names no directory")
        return "file", url, ""  # a plain path
    if parsed.query or parsed.fragment:  # no store takes one: dropped, it would go unseen
        raise ConfigError(
            f"store URL {url[:300]!r} has a query or a fragment (?… or #…), which no store takes"
        )
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"file URL {url!r} must be file:///absolute/path")
        if not parsed.path:
            raise ConfigError(f"store URL {url!r} names no directory")
        return "file", unquote(parsed.path), ""
    if scheme in ("s3", "gs"):
        if not parsed.netloc:
            raise ConfigError(f"store URL {url!r} names no bucket")
        if not _BUCKET.match(parsed.netloc):
            raise ConfigError(
                f"store URL {url[:300]!r} names an invalid bucket: use letters, digits, '.', "
                "'-' and '_' (at most 255)"
            )
        return scheme, parsed.netloc, parsed.path.strip("/")
    raise ConfigError(
        f"unsupported store URL {url!r}: use s3://bucket/prefix, gs://bucket/prefix, "
        "file:///dir or a directory path"
    )
