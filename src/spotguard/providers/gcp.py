"""Google Compute Engine provider (google-cloud-compute, imported lazily; calls in threads).

Catalog: ``machineTypes.list`` per zone — A2/A3/G2 types carry their GPUs (``accelerators``) —
and ``acceleratorTypes.list`` for GPUs attached to N1 machines (T4, V100, P100, P4), offered
as ``gcp_attach_machine_type`` plus that accelerator. Verbs: ``instances.insert`` with guest
accelerators, ``scheduling.provisioningModel=SPOT`` and an ``instanceTerminationAction`` (or
STANDARD), labels ``spotguard-managed`` / ``spotguard-job`` / ``spotguard-launch``, and the
assignment as both ``startup-script`` and ``user-data`` metadata. The instance name and the
``requestId`` derive from the client token, so repeating a launch never makes a second VM.

Errors are mapped here once: ``ZONE_RESOURCE_POOL_EXHAUSTED*`` / quota → :class:`CapacityError`
(next zone), 400/401/403/404 → :class:`PrecheckError`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field

from spotguard.config import Settings
from spotguard.contracts import LABEL_JOB, LABEL_MANAGED, Assignment
from spotguard.errors import CapacityError, PrecheckError, ProviderError, UnknownInstanceType
from spotguard.providers.base import (
    LABEL_LAUNCH,
    InstanceRef,
    InstanceState,
    InstanceTypeInfo,
    LaunchSpec,
    Market,
    Offer,
    offers_from_catalog,
    round_of,
)
from spotguard.providers.gpus import canonical_gpu

log = logging.getLogger(__name__)

CAPACITY_CODES = frozenset(
    {
        "ZONE_RESOURCE_POOL_EXHAUSTED",
        "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
        "QUOTA_EXCEEDED",
        "RESOURCE_NOT_READY",
    }
)
_STATES = {
    "PROVISIONING": InstanceState.PENDING,
    "STAGING": InstanceState.PENDING,
    "RUNNING": InstanceState.RUNNING,
    "STOPPING": InstanceState.STOPPED,
    "SUSPENDING": InstanceState.STOPPED,
    "SUSPENDED": InstanceState.STOPPED,
    "STOPPED": InstanceState.STOPPED,
    "TERMINATED": InstanceState.TERMINATED,
}
_NS = uuid.UUID("6d1c7e53-5e0f-4d3b-9b7a-0f5f3c2a9e11")

#: GPU memory (MiB) of accelerators whose catalog entry does not say it.
_GPU_MEMORY_MIB = {
    "h100": 81920,
    "h200": 143360,
    "a100-40gb": 40960,
    "a100-80gb": 81920,
    "l4": 23034,
    "t4": 15360,
    "v100": 16384,
    "p100": 16384,
    "p4": 8192,
}


class GcpSettings(Settings):
    """Where and how the GCP provider launches instances."""

    section: ClassVar[str] = "gcp"
    gcp_project: str | None = Field(None, description="GCP project id")
    gcp_zones: list[str] = Field(
        default_factory=lambda: ["us-central1-a", "us-central1-b", "us-central1-c"],
        description="Zones to launch in, in failover order (regions follow from them)",
    )
    gcp_image: str = Field(
        "projects/debian-cloud/global/images/family/debian-12",
        description="Boot image (the spotguard machine image in production)",
    )
    gcp_network: str = Field("global/networks/default", description="VPC network")
    gcp_subnetwork: str | None = Field(None, description="Subnetwork (regional) if not auto")
    gcp_service_account: str | None = Field(None, description="Service account e-mail of VMs")
    gcp_job_service_accounts: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Job name → the service account its VMs run as (terraform/gcp makes one per job); "
            "jobs not named here use gcp_service_account"
        ),
    )
    gcp_disk_gb: int = Field(100, gt=0, description="Boot disk size in GB")
    gcp_termination_action: str = Field(
        "DELETE", description="What GCE does to a preempted SPOT VM: DELETE or STOP"
    )
    gcp_attach_machine_type: str = Field(
        "n1-standard-8", description="Machine type for attachable GPUs (T4, V100, P100, P4)"
    )
    gcp_api_endpoint: str | None = Field(
        None, description="Compute API endpoint override (tests use a local HTTP fake)"
    )
    gcp_poll_s: float = Field(5.0, gt=0, description="Seconds between instance state polls")


def map_error(exc: BaseException, what: str) -> ProviderError:
    """One place that turns google-api-core errors into spotguard's provider errors."""
    codes = {str(getattr(e, "code", "")) for e in (getattr(exc, "errors", None) or [])}
    response = getattr(exc, "response", None)
    err = getattr(response, "error", None)
    for e in getattr(err, "errors", None) or []:
        codes.add(str(getattr(e, "code", "")))
    text = f"{exc}"
    codes |= {c for c in CAPACITY_CODES if c in text}
    status = getattr(exc, "code", None)
    msg = f"Compute {what} failed: {', '.join(sorted(c for c in codes if c)) or status}: {text}"
    if codes & CAPACITY_CODES:
        return CapacityError(msg)
    if isinstance(status, int) and status in (400, 401, 403, 404, 409, 412):
        return PrecheckError(msg)
    return ProviderError(msg)


def _label(value: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "_", value.lower())[:63]


def instance_name(job: str, client_token: str) -> str:
    """A valid, deterministic GCE instance name for a launch attempt."""
    j = re.sub(r"[^a-z0-9-]", "-", job.lower())[:28].strip("-")
    t = re.sub(r"[^a-z0-9-]", "-", client_token.lower())[:26]
    return f"sg-{j}-{t}".strip("-")


def _last(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


class GcpProvider:
    """Compute Engine behind :class:`~spotguard.providers.base.CloudProvider`."""

    name = "gcp"

    def __init__(self, settings: GcpSettings) -> None:
        self.settings = settings
        if not self.settings.gcp_zones:
            raise PrecheckError("gcp_zones is empty: name at least one zone")
        self._clients: dict[str, Any] = {}
        self._catalog: dict[str, list[InstanceTypeInfo]] = {}
        self._lock = asyncio.Lock()

    def regions(self) -> list[str]:
        out: list[str] = []
        for z in self.settings.gcp_zones:
            if _region(z) not in out:
                out.append(_region(z))
        return out

    def _project(self) -> str:
        if not self.settings.gcp_project:
            raise PrecheckError("set gcp_project (SPOTGUARD_GCP_PROJECT) to use the GCP provider")
        return self.settings.gcp_project

    def _client(self, kind: str) -> Any:
        if kind not in self._clients:
            from google.cloud import compute_v1

            kwargs: dict[str, Any] = {"transport": "rest"}
            if self.settings.gcp_api_endpoint:
                from google.api_core.client_options import ClientOptions
                from google.auth.credentials import AnonymousCredentials

                kwargs["client_options"] = ClientOptions(
                    api_endpoint=self.settings.gcp_api_endpoint
                )
                kwargs["credentials"] = AnonymousCredentials()  # type: ignore[no-untyped-call]
            cls = {
                "machine_types": compute_v1.MachineTypesClient,
                "accelerator_types": compute_v1.AcceleratorTypesClient,
                "instances": compute_v1.InstancesClient,
            }[kind]
            self._clients[kind] = cls(**kwargs)
        return self._clients[kind]

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        from google.api_core.exceptions import GoogleAPIError

        try:
            return await asyncio.to_thread(fn)
        except GoogleAPIError as exc:
            raise map_error(exc, what) from exc

    # ----- catalog -----------------------------------------------------------------------

    async def _zone_types(self, zone: str) -> list[InstanceTypeInfo]:
        async with self._lock:
            if zone in self._catalog:
                return self._catalog[zone]
            project = self._project()
            mts = self._client("machine_types")
            ats = self._client("accelerator_types")

            def fetch() -> tuple[list[Any], list[Any]]:
                return (
                    list(mts.list(project=project, zone=zone)),
                    list(ats.list(project=project, zone=zone)),
                )

            machine_types, accel_types = await self._call(f"catalog of {zone}", fetch)
            out: list[InstanceTypeInfo] = []
            by_name = {m.name: m for m in machine_types}
            for m in machine_types:
                accs = list(m.accelerators)
                model = canonical_gpu(accs[0].guest_accelerator_type) if accs else None
                out.append(
                    InstanceTypeInfo(
                        name=m.name,
                        gpu_model=model,
                        gpu_count=sum(a.guest_accelerator_count for a in accs),
                        gpu_memory_mib=_GPU_MEMORY_MIB.get(model or ""),
                        vcpus=m.guest_cpus,
                        memory_mib=m.memory_mb,
                    )
                )
            host = by_name.get(self.settings.gcp_attach_machine_type)
            if host is not None:
                for a in accel_types:
                    model = canonical_gpu(a.name)
                    n = 1
                    while n <= a.maximum_cards_per_instance:
                        out.append(
                            InstanceTypeInfo(
                                name=f"{host.name}+{a.name}x{n}",
                                gpu_model=model,
                                gpu_count=n,
                                gpu_memory_mib=_GPU_MEMORY_MIB.get(model or ""),
                                vcpus=host.guest_cpus,
                                memory_mib=host.memory_mb,
                            )
                        )
                        n *= 2
            self._catalog[zone] = out
            return out

    async def instance_types(self, region: str | None = None) -> list[InstanceTypeInfo]:
        seen: dict[str, InstanceTypeInfo] = {}
        for zone in self.settings.gcp_zones:
            if region is None or _region(zone) == region:
                for t in await self._zone_types(zone):
                    seen.setdefault(t.name, t)
        return list(seen.values())

    async def instance_type(self, name: str) -> InstanceTypeInfo:
        for t in await self.instance_types():
            if t.name == name:
                return t
        raise UnknownInstanceType(
            f"unknown GCE machine type {name!r} in zones {', '.join(self.settings.gcp_zones)}"
        )

    async def offers(self, spec: LaunchSpec) -> list[Offer]:
        out: list[Offer] = []
        for zone in self.settings.gcp_zones:
            region = _region(zone)
            if spec.target_region and region != spec.target_region:
                continue
            types = await self._zone_types(zone)
            fit = [t for t in types if spec.mismatch(t) is None]
            out.extend(
                offers_from_catalog(self.name, region, spec, fit, {t.name: [zone] for t in fit})
            )
        return out

    # ----- verbs -------------------------------------------------------------------------

    def _instance(self, offer: Offer, assignment: Assignment, name: str, round_token: str) -> Any:
        from google.cloud import compute_v1

        s = self.settings
        machine, _, attach = offer.instance_type.partition("+")
        accels = []
        if attach:
            acc_name, _, count = attach.rpartition("x")
            accels = [
                compute_v1.AcceleratorConfig(
                    accelerator_type=f"zones/{offer.zone}/acceleratorTypes/{acc_name}",
                    accelerator_count=int(count),
                )
            ]
        spot = offer.market is Market.SPOT
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT" if spot else "STANDARD",
            on_host_maintenance="TERMINATE",
            automatic_restart=False,
        )
        if spot:
            scheduling.instance_termination_action = s.gcp_termination_action
        script = assignment.user_data()
        nic = compute_v1.NetworkInterface(network=s.gcp_network)
        if s.gcp_subnetwork:
            nic.subnetwork = s.gcp_subnetwork
        inst = compute_v1.Instance(
            name=name,
            machine_type=f"zones/{offer.zone}/machineTypes/{machine}",
            guest_accelerators=accels,
            scheduling=scheduling,
            labels={
                LABEL_MANAGED: "true",
                LABEL_JOB: _label(assignment.job),
                LABEL_LAUNCH: _label(round_token),
            },
            metadata=compute_v1.Metadata(
                items=[
                    compute_v1.Items(key="startup-script", value=script),
                    compute_v1.Items(key="user-data", value=script),
                ]
            ),
            disks=[
                compute_v1.AttachedDisk(
                    boot=True,
                    auto_delete=True,
                    initialize_params=compute_v1.AttachedDiskInitializeParams(
                        source_image=s.gcp_image,
                        disk_size_gb=s.gcp_disk_gb,
                        labels={LABEL_MANAGED: "true", LABEL_JOB: _label(assignment.job)},
                    ),
                )
            ],
            network_interfaces=[nic],
        )
        account = s.gcp_job_service_accounts.get(assignment.job, s.gcp_service_account)
        if account:
            inst.service_accounts = [
                compute_v1.ServiceAccount(
                    email=account,
                    scopes=["https://www.googleapis.com/auth/cloud-platform"],
                )
            ]
        return inst

    async def launch(
        self, offer: Offer, assignment: Assignment, *, client_token: str
    ) -> InstanceRef:
        project = self._project()
        round_token = round_of(client_token)
        name = instance_name(assignment.job, client_token)
        body = self._instance(offer, assignment, name, round_token)
        instances = self._client("instances")
        request_id = str(uuid.uuid5(_NS, client_token))

        def insert() -> None:
            from google.cloud import compute_v1

            req = compute_v1.InsertInstanceRequest(
                project=project, zone=offer.zone, instance_resource=body, request_id=request_id
            )
            instances.insert(request=req).result(timeout=300)

        log.info(
            "launching",
            extra={"job": assignment.job, "offer": offer.label(), "instance": name},
        )
        try:
            await self._call("instances.insert", insert)
        except PrecheckError as exc:
            if "409" not in str(exc) and "alreadyExists" not in str(exc):
                raise
            # The same token already made this instance: that launch is ours.
        return await self._get(offer.zone, name, round_token)

    async def _get(self, zone: str, name: str, token: str | None) -> InstanceRef:
        project = self._project()
        instances = self._client("instances")
        inst = await self._call(
            "instances.get", lambda: instances.get(project=project, zone=zone, instance=name)
        )
        return self._ref(inst, zone, token)

    def _ref(self, inst: Any, zone: str, token: str | None) -> InstanceRef:
        spot = inst.scheduling.provisioning_model == "SPOT"
        return InstanceRef(
            provider=self.name,
            instance_id=inst.name,
            region=_region(zone),
            zone=zone,
            instance_type=_last(inst.machine_type),
            market=Market.SPOT if spot else Market.ON_DEMAND,
            launch_token=dict(inst.labels).get(LABEL_LAUNCH, token),
            state=_STATES.get(inst.status, InstanceState.PENDING),
            extra={"id": str(inst.id)},
        )

    async def describe(self, ref: InstanceRef) -> InstanceRef:
        try:
            return await self._get(ref.zone, ref.instance_id, ref.launch_token)
        except PrecheckError as exc:
            if "404" in str(exc):
                return ref.with_state(InstanceState.TERMINATED)
            raise

    async def wait_ready(self, ref: InstanceRef, timeout_s: float) -> InstanceRef:
        deadline = time.monotonic() + timeout_s
        while True:
            cur = await self.describe(ref)
            if cur.state is InstanceState.RUNNING:
                return cur
            if cur.state is InstanceState.TERMINATED:
                raise CapacityError(f"instance {ref.instance_id} terminated before it ran")
            if time.monotonic() > deadline:
                raise ProviderError(f"instance {ref.instance_id} not running after {timeout_s}s")
            await asyncio.sleep(self.settings.gcp_poll_s)

    async def terminate(self, ref: InstanceRef) -> None:
        project = self._project()
        instances = self._client("instances")

        def delete() -> None:
            instances.delete(project=project, zone=ref.zone, instance=ref.instance_id).result(
                timeout=300
            )

        try:
            await self._call("instances.delete", delete)
        except PrecheckError as exc:
            if "404" not in str(exc):
                raise

    async def find_by_token(self, token: str) -> InstanceRef | None:
        project = self._project()
        instances = self._client("instances")
        flt = f'labels.{LABEL_LAUNCH} = "{_label(token)}"'

        def listing(zone: str) -> Callable[[], list[Any]]:
            from google.cloud import compute_v1

            req = compute_v1.ListInstancesRequest(project=project, zone=zone, filter=flt)
            return lambda: list(instances.list(request=req))

        for zone in self.settings.gcp_zones:
            for inst in await self._call("instances.list", listing(zone)):
                ref = self._ref(inst, zone, token)
                if ref.state is not InstanceState.TERMINATED:
                    return ref
        return None

    async def aclose(self) -> None:
        for c in self._clients.values():
            transport = getattr(c, "transport", None)
            close = getattr(transport, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
        self._clients.clear()
