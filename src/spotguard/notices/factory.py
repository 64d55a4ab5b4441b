"""The one place that answers "which cloud is this, and what watches it?", from the
``[notices]`` settings (:class:`~spotguard.notices.settings.NoticeSettings`, loaded by the
caller): the agent, ``spotguard notices`` and the instance facts all ask here.

=========  ====================================================================================
cloud      :func:`resolve_cloud`
=========  ====================================================================================
``none``   None at once (no metadata service is asked: operator drains, periodic checkpoints)
``aws``…   that cloud, without detection
``auto``   the cloud whose metadata service answers within ``detect_timeout``, else None
=========  ====================================================================================
"""

from __future__ import annotations

import logging

from spotguard.errors import ConfigError, MetadataUnavailable
from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Cloud, NoticeSource
from spotguard.notices.detect import detect_cloud
from spotguard.notices.endpoints import aws_endpoint, azure_endpoint, gcp_endpoint
from spotguard.notices.gcp import GcpMetadataSource
from spotguard.notices.settings import NoticeSettings

log = logging.getLogger(__name__)


async def resolve_cloud(s: NoticeSettings) -> Cloud | None:
    """The cloud to watch (see the module docstring); None when there is none."""
    if s.cloud == "none":
        return None
    if s.cloud != "auto":
        return Cloud(s.cloud)
    found = await detect_cloud(s.detect_timeout, imdsv1=s.imdsv1)
    log.info("cloud detected", extra={"step": "detect", "cloud": found.value if found else None})
    return found


def source_for(cloud: Cloud | str, s: NoticeSettings) -> NoticeSource:
    """The metadata notice source of ``cloud`` (aws, gcp or azure)."""
    cloud = Cloud(cloud)
    if cloud is Cloud.AWS:
        return AwsImdsSource(
            poll_interval=s.poll_interval, token_ttl=s.token_ttl, imdsv1=s.imdsv1, timeout=s.timeout
        )
    if cloud is Cloud.GCP:
        return GcpMetadataSource(timeout=s.timeout, long_poll=s.long_poll)
    if cloud is Cloud.AZURE:
        return AzureEventsSource(poll_interval=s.poll_interval, timeout=s.timeout)
    raise ConfigError(f"{cloud} has no metadata notice source")


async def metadata_source(s: NoticeSettings) -> NoticeSource:
    """The notice source for this machine's cloud, for callers that need one: ConfigError
    for ``cloud = none``, MetadataUnavailable when ``auto`` finds no metadata service."""
    if s.cloud == "none":
        raise ConfigError("cloud = none: no metadata service is watched on this machine")
    cloud = await resolve_cloud(s)
    if cloud is None:
        raise MetadataUnavailable(
            "no cloud metadata service answered within "
            f"{s.detect_timeout} s (tried AWS at {aws_endpoint()}, GCP at {gcp_endpoint()}, "
            f"Azure at {azure_endpoint()}); set --cloud or the endpoint variables"
        )
    return source_for(cloud, s)
