"""Where am I running? Instance facts and user-data from the cloud's metadata service.

The agent records :class:`~spotguard.facts.InstanceFacts` in every image's manifest and report,
and reads its assignment from user-data on a freshly launched VM:

=======  ===========================================  ============================================
cloud    facts                                        user-data
=======  ===========================================  ============================================
aws      ``meta-data/instance-id``, ``instance-type``, ``/latest/user-data``
         ``placement/availability-zone``,
         ``placement/region``, ``instance-life-cycle``
gcp      ``instance/id``, ``machine-type``, ``zone``,  ``instance/attributes/user-data``, else
         ``scheduling/provisioning-model``            ``instance/attributes/startup-script``
azure    ``/metadata/instance`` ``compute``: vmId,     ``compute/userData`` (base64)
         vmSize, location, zone, priority
=======  ===========================================  ============================================

``cloud`` comes from :func:`spotguard.notices.factory.resolve_cloud` (None: no metadata
service, and the facts say ``local``). Every request goes through the cloud's one metadata
client, built from the ``[notices]`` settings — so an AWS host that refuses IMDSv2 tokens and
allows IMDSv1 (``imdsv1 = true``) gives its facts the same way it gives its notices.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from spotguard.errors import MetadataMalformed, MetadataUnavailable
from spotguard.facts import InstanceFacts
from spotguard.notices.aws import ImdsClient
from spotguard.notices.azure import AzureMetadataClient
from spotguard.notices.base import Cloud
from spotguard.notices.gcp import GcpMetadataClient
from spotguard.notices.settings import NoticeSettings


def _cloud(cloud: Cloud | str | None) -> Cloud | None:
    resolved = None if cloud is None else Cloud(cloud)
    return resolved if resolved in (Cloud.AWS, Cloud.GCP, Cloud.AZURE) else None


async def instance_facts(
    cloud: Cloud | str | None, settings: NoticeSettings, *, endpoint: str | None = None
) -> InstanceFacts:
    """Facts about this instance from ``cloud``'s metadata service (``local`` without one)."""
    resolved = _cloud(cloud)
    if resolved is Cloud.AWS:
        return await _aws_facts(ImdsClient.from_settings(settings, endpoint))
    if resolved is Cloud.GCP:
        return await _gcp_facts(GcpMetadataClient.from_settings(settings, endpoint))
    if resolved is Cloud.AZURE:
        compute = await _azure_compute(AzureMetadataClient.from_settings(settings, endpoint))
        zone = str(compute.get("zone") or "") or None
        return InstanceFacts(
            provider="azure",
            instance_type=_str(compute.get("vmSize")),
            region=_str(compute.get("location")),
            zone=zone,
            instance_id=_str(compute.get("vmId")),
            spot=str(compute.get("priority", "")).lower() == "spot",
            extra={"name": compute.get("name")},
        )
    return InstanceFacts(provider="local")


async def user_data(
    cloud: Cloud | str | None, settings: NoticeSettings, *, endpoint: str | None = None
) -> str | None:
    """This instance's user-data (GCP: ``user-data`` or ``startup-script``), None when unset."""
    resolved = _cloud(cloud)
    if resolved is Cloud.AWS:
        imds = ImdsClient.from_settings(settings, endpoint)
        try:
            return await imds.get_text("/latest/user-data")
        finally:
            await imds.aclose()
    if resolved is Cloud.GCP:
        gcp = GcpMetadataClient.from_settings(settings, endpoint)
        try:
            for key in ("user-data", "startup-script"):
                value = await gcp.get_text(f"instance/attributes/{key}")
                if value is not None:
                    return value
            return None
        finally:
            await gcp.aclose()
    if resolved is Cloud.AZURE:
        azure = AzureMetadataClient.from_settings(settings, endpoint)
        encoded = _str((await _azure_compute(azure)).get("userData"))
        if not encoded:
            return None
        try:
            return base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise MetadataMalformed("Azure compute.userData is not base64 UTF-8 text") from exc
    return None


def _str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


async def _aws_facts(imds: ImdsClient) -> InstanceFacts:
    try:
        got = {}
        for key, path in (
            ("instance_id", "instance-id"),
            ("instance_type", "instance-type"),
            ("zone", "placement/availability-zone"),
            ("region", "placement/region"),
            ("life_cycle", "instance-life-cycle"),
        ):
            value = await imds.get_text(f"/latest/meta-data/{path}")
            got[key] = value.strip() if value else None
    finally:
        await imds.aclose()
    if not got["instance_id"]:
        raise MetadataUnavailable("AWS metadata has no instance-id")
    return InstanceFacts(
        provider="aws",
        instance_type=got["instance_type"],
        region=got["region"] or (got["zone"][:-1] if got["zone"] else None),
        zone=got["zone"],
        instance_id=got["instance_id"],
        spot=None if got["life_cycle"] is None else got["life_cycle"] == "spot",
    )


async def _gcp_facts(gcp: GcpMetadataClient) -> InstanceFacts:
    try:
        got = {}
        for key, path in (
            ("instance_id", "instance/id"),
            ("machine_type", "instance/machine-type"),
            ("zone", "instance/zone"),
            ("model", "instance/scheduling/provisioning-model"),
            ("preemptible", "instance/scheduling/preemptible"),
        ):
            value = await gcp.get_text(path)
            got[key] = value.strip() if value else None
    finally:
        await gcp.aclose()
    zone = got["zone"].rsplit("/", 1)[-1] if got["zone"] else None
    spot = got["model"] in ("SPOT",) or got["preemptible"] == "TRUE"
    return InstanceFacts(
        provider="gcp",
        instance_type=got["machine_type"].rsplit("/", 1)[-1] if got["machine_type"] else None,
        region=zone.rsplit("-", 1)[0] if zone else None,
        zone=zone,
        instance_id=got["instance_id"],
        spot=spot if (got["model"] or got["preemptible"]) else None,
    )


async def _azure_compute(client: AzureMetadataClient) -> dict[str, Any]:
    try:
        return await client.compute()
    finally:
        await client.aclose()
