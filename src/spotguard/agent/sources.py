"""The agent's notice sources for the configured (or detected) cloud, and this VM's facts.

A thin layer over :mod:`spotguard.notices.factory`: the agent must start (and serve operator
drains) on a machine where no metadata service answers, so "no cloud" is not an error here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from spotguard.errors import NoticeError
from spotguard.facts import InstanceFacts
from spotguard.notices.base import NoticeSource, cloud_of
from spotguard.notices.factory import resolve_cloud, source_for
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
        clouds = {c.value for src in given if (c := cloud_of(src)) is not None} - {"manual"}
        return (clouds.pop() if len(clouds) == 1 else None), list(given)
    if s.cloud == "none":
        log.info("no metadata source (cloud = none)", extra={"step": "detect", "cloud": "none"})
    cloud = await resolve_cloud(s)
    if cloud is None:
        return None, []
    return cloud.value, [source_for(cloud, s)]


async def instance_facts(cloud: str | None, s: NoticeSettings) -> InstanceFacts:
    """This VM's facts from its metadata service; plain local facts when there is none or
    it does not answer (reports must never wait on this)."""
    if cloud is None:
        return InstanceFacts()
    try:
        return await read_facts(cloud, s)
    except NoticeError as exc:
        log.warning(
            "instance facts unavailable", extra={"step": "facts", "cloud": cloud, "error": str(exc)}
        )
        return InstanceFacts(provider=cloud)
