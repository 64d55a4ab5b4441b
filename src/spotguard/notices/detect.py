"""Which cloud is this? Ask the three metadata services at once, with a short time limit each,
and take the first that answers the way only that cloud does:

* AWS — ``PUT /latest/api/token`` returns an IMDSv2 token (or, with IMDSv1 allowed, a GET of
  ``/latest/meta-data/instance-id`` answers);
* GCP — ``GET /computeMetadata/v1/instance/id`` answers with ``Metadata-Flavor: Google``;
* Azure — ``GET /metadata/instance?api-version=...`` answers JSON with a ``compute`` object.

Endpoints follow :mod:`spotguard.notices.endpoints` (so an emulator is found the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from spotguard.errors import MetadataMalformed, NoticeError
from spotguard.notices.aws import ImdsClient
from spotguard.notices.azure import AzureMetadataClient
from spotguard.notices.base import Cloud
from spotguard.notices.gcp import GcpMetadataClient

log = logging.getLogger(__name__)


async def _aws(timeout_s: float, imdsv1: bool, endpoint: str | None) -> bool:
    imds = ImdsClient(endpoint, token_ttl=60, imdsv1=imdsv1, timeout=timeout_s)
    try:
        return bool(await imds.get_text("/latest/meta-data/instance-id"))
    finally:
        await imds.aclose()


async def _gcp(timeout_s: float, endpoint: str | None) -> bool:
    client = GcpMetadataClient(endpoint, timeout=timeout_s)
    try:
        return bool(await client.get_text("instance/id"))
    finally:
        await client.aclose()


async def _azure(timeout_s: float, endpoint: str | None) -> bool:
    client = AzureMetadataClient(endpoint, timeout=timeout_s)
    try:
        await client.compute()
        return True
    except MetadataMalformed:
        return False
    finally:
        await client.aclose()


async def detect_cloud(
    timeout_s: float = 0.3,
    *,
    imdsv1: bool = False,
    aws_endpoint: str | None = None,
    gcp_endpoint: str | None = None,
    azure_endpoint: str | None = None,
) -> Cloud | None:
    """The cloud whose metadata service answers properly first, or None when none does."""
    probes = {
        asyncio.ensure_future(_aws(timeout_s, imdsv1, aws_endpoint)): Cloud.AWS,
        asyncio.ensure_future(_gcp(timeout_s, gcp_endpoint)): Cloud.GCP,
        asyncio.ensure_future(_azure(timeout_s, azure_endpoint)): Cloud.AZURE,
    }
    pending = set(probes)
    found: Cloud | None = None
    try:
        while pending and found is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                try:
                    if task.result():
                        found = probes[task]
                        break
                except NoticeError as exc:
                    log.debug("no %s metadata: %s", probes[task].value, exc)
    finally:
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, NoticeError):
                await task
    log.debug("cloud detection", extra={"cloud": found.value if found else None})
    return found
