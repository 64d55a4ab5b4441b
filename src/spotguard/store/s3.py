"""Amazon S3 (and S3-compatible) store: ``s3://bucket[/prefix]``.

boto3 directly: an object up to ``multipart_threshold`` (128 MiB, above the default chunk
size) goes up in one PUT — a chunk upload is one request, and parallelism comes from many
chunks in flight; a larger one as a multipart upload whose parts are sent in parallel. Every
request carries a CRC32 checksum that the server checks (transport integrity; CRC32 costs a
third of SHA-256 on the client, and content integrity is the image layer's BLAKE3 of every
chunk, verified on restore); a failed part is retried on its own and a failed upload is
aborted. The endpoint comes from the standard
``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` variables (botocore reads them), so the same code
runs against AWS, MinIO or a moto server. ``if_absent`` writes use ``If-None-Match: *``.
Optional server-side encryption: ``sse="AES256"`` or ``sse="aws:kms"`` with ``sse_kms_key_id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any, Literal, cast

from spotguard.errors import ObjectNotFound, PreconditionFailed, StoreError, StoreUnavailable
from spotguard.store.base import BlockingStore, Data, ObjectInfo, RetryPolicy

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "RequestTimeTooSkewed",
    "OperationAborted",
    "ConditionalRequestConflict",
}
#: Answers that say the store (or the account's quota) is full, or the object too large: a
#: retry within a notice's deadline cannot fix them, so they are not retried.
_FULL_CODES = {
    "EntityTooLarge",
    "QuotaExceeded",
    "XMinioStorageFull",
    "StorageFull",
    "InsufficientStorage",
}
_MIN_PART = 5 << 20


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a bytes-like object, so botocore can send (and checksum,
    and rewind for a retry) a view of a reused buffer without a copy of the whole object."""

    def __init__(self, data: Data) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else self._pos + size
        out = bytes(self._view[self._pos : end])
        self._pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = min(len(out), len(self._view) - self._pos)
        out[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def __len__(self) -> int:
        return len(self._view)


def _body(data: Data) -> bytes | IO[Any]:
    if isinstance(data, bytes):
        return data
    return cast(IO[Any], _ViewReader(data))


class S3Store(BlockingStore):
    """Objects under ``s3://bucket/prefix``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        io_workers: int = 16,
        retry: RetryPolicy | None = None,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        multipart_threshold: int = 128 << 20,
        part_size: int = 16 << 20,
        checksum: Literal["SHA256", "CRC32", "CRC32C"] = "CRC32",
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        super().__init__(url, io_workers=io_workers, retry=retry)
        self.sse = sse or None
        self.sse_kms_key_id = sse_kms_key_id or None
        self.multipart_threshold = max(multipart_threshold, _MIN_PART)
        self.part_size = max(part_size, _MIN_PART)
        self.checksum = checksum
        self._client: S3Client | None = None

    @property
    def client(self) -> S3Client:
        """The boto3 client, made on first use (boto3 is imported only here)."""
        if self._client is None:
            import boto3
            from botocore.config import Config

            cfg = Config(
                max_pool_connections=self.io_workers + 4,
                retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity retries
                connect_timeout=min(10.0, self.retry.timeout),
                read_timeout=self.retry.timeout,
                request_checksum_calculation="when_required",
                # Downloads are verified end to end by the image layer (hash of the content,
                # one refetch, then ImageCorrupt naming the chunk), so botocore need not.
                response_checksum_validation="when_required",
            )
            self._client = boto3.session.Session().client("s3", config=cfg)
        return self._client

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _unk(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.sse:
            extra["ServerSideEncryption"] = self.sse
        if self.sse_kms_key_id:
            extra["SSEKMSKeyId"] = self.sse_kms_key_id
        return extra

    # --- large objects: parallel multipart --------------------------------------------------
    async def put(self, key: str, data: Data, *, if_absent: bool = False) -> None:
        if if_absent or len(data) <= self.multipart_threshold:
            await super().put(key, data, if_absent=if_absent)
            return
        await self._multipart(key, data)

    async def _multipart(self, key: str, data: Data) -> None:
        full = self._k(key)
        created = await self._call(
            "create_multipart",
            key,
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=full, ChecksumAlgorithm=self.checksum, **self._extra()
            ),
        )
        upload_id = created["UploadId"]
        view = memoryview(data).cast("B")
        offsets = list(range(0, len(data), self.part_size))
        # A last part below the minimum joins the one before it.
        if len(offsets) > 1 and len(data) - offsets[-1] < _MIN_PART:
            offsets.pop()

        async def part(no: int, start: int) -> dict[str, Any]:
            end = offsets[no] if no < len(offsets) else len(data)
            body = view[start:end]
            r = await self._call(
                "upload_part",
                key,
                lambda: self.client.upload_part(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=no,
                    Body=cast(IO[Any], _ViewReader(body)),
                    ChecksumAlgorithm=self.checksum,
                ),
            )
            out: dict[str, Any] = {"PartNumber": no, "ETag": r["ETag"]}
            checksum = dict(r).get(f"Checksum{self.checksum}")
            if checksum:
                out[f"Checksum{self.checksum}"] = checksum
            return out

        try:
            parts = await asyncio.gather(*(part(i + 1, off) for i, off in enumerate(offsets)))
            await self._call(
                "complete_multipart",
                key,
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": list(parts)},  # type: ignore[arg-type]
                ),
            )
        except BaseException:
            await asyncio.shield(self._abort(full, upload_id))
            raise

    async def _abort(self, full: str, upload_id: str) -> None:
        # On failure the bucket's lifecycle rule for incomplete uploads cleans up.
        with contextlib.suppress(StoreError):
            await self._call(
                "abort_multipart",
                full,
                lambda: self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                ),
            )

    # --- blocking primitives ----------------------------------------------------------------
    def _put(self, key: str, data: Data, if_absent: bool) -> None:
        kwargs: dict[str, Any] = dict(self._extra())
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        self.client.put_object(
            Bucket=self.bucket,
            Key=self._k(key),
            Body=_body(data),
            ChecksumAlgorithm=self.checksum,
            **kwargs,
        )

    def _get(self, key: str) -> bytes:
        r = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        body = r["Body"]
        try:
            return body.read()
        finally:
            body.close()

    def _get_capped(self, key: str, limit: int) -> bytes:
        r = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        body = r["Body"]
        try:
            data: bytes = body.read(limit + 1)
            return data
        finally:
            body.close()

    def _get_into(self, key: str, buf: memoryview) -> memoryview:
        r = self.client.get_object(Bucket=self.bucket, Key=self._k(key))
        body = r["Body"]
        try:
            size = r.get("ContentLength")
            if not isinstance(size, int) or size > len(buf):
                # no Content-Length (a chunked answer), or larger than the caller can use:
                # read one byte more than fits, never the whole of an oversized object
                return memoryview(body.read(len(buf) + 1))
            got = 0
            while got < size:
                n = body.readinto(cast(Any, buf[got:size]))
                if not n:
                    break
                got += n
            return buf[:got]
        finally:
            body.close()

    def _stat(self, key: str) -> ObjectInfo | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.head_object(Bucket=self.bucket, Key=self._k(key))
        except ClientError as exc:
            if _status(exc) == 404:
                return None
            raise
        size, modified = r.get("ContentLength"), r.get("LastModified")
        if not isinstance(size, int) or not isinstance(modified, datetime):
            missing = "Content-Length" if not isinstance(size, int) else "Last-Modified"
            raise StoreError(
                f"{self.url}/{key}: the server's HEAD answer has no {missing} header "
                "(is the endpoint an S3-compatible server?)"
            )
        return ObjectInfo(key, size, modified.astimezone(UTC))

    def _list(self, prefix: str) -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._k(prefix)
        )
        for page in pages:
            for obj in page.get("Contents", []):
                modified: datetime = obj["LastModified"]
                out.append(ObjectInfo(self._unk(obj["Key"]), obj["Size"], modified.astimezone(UTC)))
        return out

    def _list_dirs(self, prefix: str) -> list[str]:
        full = self._k(prefix)
        if full and not full.endswith("/"):
            full += "/"
        out: list[str] = []
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=full, Delimiter="/"
        )
        for page in pages:
            for cp in page.get("CommonPrefixes", []):
                out.append(cp["Prefix"][len(full) :].rstrip("/"))
        return out

    def _delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._k(key))

    def _map_error(self, exc: Exception, key: str) -> StoreError | None:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            HTTPClientError,
            IncompleteReadError,
            NoCredentialsError,
            ResponseStreamingError,
        )
        from urllib3.exceptions import HTTPError as Urllib3Error  # type: ignore[import-untyped]

        where = f"{self.url}/{key}"
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = _status(exc)
            msg = str(err.get("Message", "")) or code
            if code in ("NoSuchKey", "NotFound") or (status == 404 and code != "NoSuchBucket"):
                return ObjectNotFound(f"{where} does not exist")
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist ({self.url})")
            if status == 412 or code == "PreconditionFailed":
                return PreconditionFailed(f"{where} already exists")
            if code in _FULL_CODES or status in (413, 507):
                return StoreError(f"{where}: no room in the store: {code or status} {msg}".rstrip())
            if code in _TRANSIENT_CODES or status in (429, 500, 502, 503, 504) or status >= 500:
                return StoreUnavailable(f"{where}: {code or status} {msg}".rstrip())
            return StoreError(f"{where}: {code} {msg}".rstrip())
        if isinstance(exc, NoCredentialsError):
            return StoreError(f"{self.url}: no AWS credentials found")
        if isinstance(
            exc,
            ConnectionError
            | HTTPClientError
            | IncompleteReadError
            | ResponseStreamingError
            | Urllib3Error,
        ):
            return StoreUnavailable(f"{where}: {exc}")
        if isinstance(exc, BotoCoreError):
            return StoreError(f"{where}: {exc}")
        return None


def _status(exc: Any) -> int:
    meta = exc.response.get("ResponseMetadata", {})
    try:
        return int(meta.get("HTTPStatusCode", 0))
    except (TypeError, ValueError):
        return 0
