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

``cloud`` may be None to detect it; with no metadata service at all the facts say ``local``.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from spotguard.errors import MetadataMalformed, MetadataUnavailable
from spotguard.facts import InstanceFacts
from spotguard.notices.aws import ImdsClient
from spotguard.notices.base import Cloud
from spotguard.notices.detect import detect_cloud
from spotguard.notices.endpoints import azure_endpoint
from spotguard.notices.fetch import MetadataHttp
from spotguard.notices.gcp import GcpMetadataClient

AZURE_API = "2021-02-01"


async def _resolve(cloud: Cloud | str | None, timeout_s: float) -> Cloud | None:
    if cloud is None or cloud == "auto":
        return await detect_cloud(min(timeout_s, 0.5))
    resolved = Cloud(cloud)
    if resolved not in (Cloud.AWS, Cloud.GCP, Cloud.AZURE):
        return None
    return resolved


async def instance_facts(
    cloud: Cloud | str | None = None, *, timeout_s: float = 2.0, endpoint: str | None = None
) -> InstanceFacts:
    """Facts about this instance from ``cloud``'s metadata service (``local`` without one)."""
    resolved = await _resolve(cloud, timeout_s)
    if resolved is Cloud.AWS:
        return await _aws_facts(endpoint, timeout_s)
    if resolved is Cloud.GCP:
        return await _gcp_facts(endpoint, timeout_s)
    if resolved is Cloud.AZURE:
        compute = await _azure_compute(endpoint, timeout_s)
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
    cloud: Cloud | str | None = None, *, timeout_s: float = 2.0, endpoint: str | None = None
) -> str | None:
    """This instance's user-data (GCP: ``user-data`` or ``startup-script``), None when unset."""
    resolved = await _resolve(cloud, timeout_s)
    if resolved is Cloud.AWS:
        imds = ImdsClient(endpoint, token_ttl=60, timeout=timeout_s)
        try:
            return await imds.get_text("/latest/user-data")
        finally:
            await imds.aclose()
    if resolved is Cloud.GCP:
        gcp = GcpMetadataClient(endpoint, timeout=timeout_s)
        try:
            for key in ("user-data", "startup-script"):
                value = await gcp.get_text(f"instance/attributes/{key}")
                if value is not None:
                    return value
            return None
        finally:
            await gcp.aclose()
    if resolved is Cloud.AZURE:
        encoded = _str((await _azure_compute(endpoint, timeout_s)).get("userData"))
        if not encoded:
            return None
        try:
            return base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise MetadataMalformed("Azure compute.userData is not base64 UTF-8 text") from exc
    return None


def _str(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


async def _aws_facts(endpoint: str | None, timeout_s: float) -> InstanceFacts:
    imds = ImdsClient(endpoint, token_ttl=60, timeout=timeout_s)
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


async def _gcp_facts(endpoint: str | None, timeout_s: float) -> InstanceFacts:
    gcp = GcpMetadataClient(endpoint, timeout=timeout_s)
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


async def _azure_compute(endpoint: str | None, timeout_s: float) -> dict[str, Any]:
    http = MetadataHttp("azure", timeout_s)
    try:
        reply = await http.request(
            "GET",
            azure_endpoint(endpoint) + "/metadata/instance",
            headers={"Metadata": "true"},
            params={"api-version": AZURE_API},
        )
    finally:
        await http.aclose()
    if reply.status != 200:
        raise MetadataUnavailable(f"{reply.url}: HTTP {reply.status}")
    doc = reply.json()
    compute = doc.get("compute") if isinstance(doc, dict) else None
    if not isinstance(compute, dict):
        raise MetadataMalformed(f"{reply.url}: answer has no compute object")
    return compute
