"""Build the notice source for a cloud from :class:`~spotguard.notices.settings.NoticeSettings`
(detecting the cloud when it is ``auto``; ``none`` means no metadata source at all)."""

from __future__ import annotations

from spotguard.config import load
from spotguard.errors import ConfigError, MetadataUnavailable
from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Cloud, NoticeSource
from spotguard.notices.detect import detect_cloud
from spotguard.notices.endpoints import aws_endpoint, azure_endpoint, gcp_endpoint
from spotguard.notices.gcp import GcpMetadataSource
from spotguard.notices.settings import NoticeSettings


def source_for(cloud: Cloud | str, settings: NoticeSettings | None = None) -> NoticeSource:
    """The metadata notice source of ``cloud`` (aws, gcp or azure)."""
    s = settings or load(NoticeSettings)
    cloud = Cloud(cloud)
    if cloud is Cloud.AWS:
        return AwsImdsSource(
            poll_interval=s.poll_interval, token_ttl=s.token_ttl, imdsv1=s.imdsv1, timeout=s.timeout
        )
    if cloud is Cloud.GCP:
        return GcpMetadataSource(timeout=s.timeout, long_poll=s.long_poll)
    if cloud is Cloud.AZURE:
        return AzureEventsSource(poll_interval=s.poll_interval, timeout=s.timeout)
    raise ValueError(f"{cloud} has no metadata notice source")


async def resolve_cloud(settings: NoticeSettings | None = None) -> Cloud:
    """The configured cloud, or the detected one for ``auto`` (MetadataUnavailable if none
    answers; ConfigError for ``none``, which asks for no metadata source)."""
    s = settings or load(NoticeSettings)
    if s.cloud == "none":
        raise ConfigError("cloud = none: no metadata service is watched on this machine")
    if s.cloud != "auto":
        return Cloud(s.cloud)
    cloud = await detect_cloud(s.detect_timeout, imdsv1=s.imdsv1)
    if cloud is None:
        raise MetadataUnavailable(
            "no cloud metadata service answered within "
            f"{s.detect_timeout} s (tried AWS at {aws_endpoint()}, GCP at {gcp_endpoint()}, "
            f"Azure at {azure_endpoint()}); set --cloud or the endpoint variables"
        )
    return cloud


async def metadata_source(settings: NoticeSettings | None = None) -> NoticeSource:
    """The notice source for this machine's cloud (configured or detected)."""
    return source_for(await resolve_cloud(settings), settings)
