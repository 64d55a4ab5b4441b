"""The agent's notice sources for the configured (or detected) cloud, and this VM's facts.

A thin layer over :mod:`spotguard.notices.factory`: the agent must start (and serve operator
drains) on a machine where no metadata service answers, so "no cloud" is not an error here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from spotguard.errors import NoticeError
from spotguard.facts import InstanceFacts
from spotguard.notices.base import NoticeSource
from spotguard.notices.detect import detect_cloud
from spotguard.notices.factory import source_for
from spotguard.notices.instance import instance_facts as read_facts
from spotguard.notices.settings import NoticeSettings

log = logging.getLogger(__name__)


async def cloud_sources(
    s: NoticeSettings, given: Sequence[NoticeSource] | None = None
) -> tuple[str | None, list[NoticeSource]]:
    """(cloud, sources): ``given`` sources as they are, else the configured cloud's source,
    else the detected one's; none when no cloud is found or ``cloud = none`` is set (only
    manual drains and periodic checkpoints then)."""
    if given is not None:
        clouds = {str(getattr(src, "cloud", "")) for src in given} - {"", "manual"}
        return (clouds.pop() if len(clouds) == 1 else None), list(given)
    if s.cloud == "none":
        # Asked for no metadata source: no detection (no delay), manual drains only.
        log.info("no metadata source (cloud = none)", extra={"step": "detect", "cloud": "none"})
        return None, []
    cloud: str | None = s.cloud
    if cloud == "auto":
        found = await detect_cloud(s.detect_timeout, imdsv1=s.imdsv1)
        cloud = found.value if found is not None else None
        log.info("cloud detected", extra={"step": "detect", "cloud": cloud or "none"})
    if cloud is None:
        return None, []
    return cloud, [source_for(cloud, s)]


async def instance_facts(cloud: str | None, s: NoticeSettings) -> InstanceFacts:
    """This VM's facts from its metadata service; plain local facts when there is none or
    it does not answer (reports must never wait on this)."""
    if cloud is None:
        return InstanceFacts()
    try:
        return await read_facts(cloud, timeout_s=s.timeout)
    except NoticeError as exc:
        log.warning(
            "instance facts unavailable", extra={"step": "facts", "cloud": cloud, "error": str(exc)}
        )
        return InstanceFacts(provider=cloud)
