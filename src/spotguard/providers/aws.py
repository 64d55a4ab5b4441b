"""AWS EC2 provider (boto3, imported lazily; every SDK call runs in a thread).

Catalog: ``DescribeInstanceTypes`` (``GpuInfo``: name, count, memory) and
``DescribeInstanceTypeOfferings`` (which zones offer a type). Verbs: ``RunInstances`` through a
launch template, with spot market options (or on-demand), the assignment as user-data, tags
``spotguard:managed`` / ``spotguard:job`` / ``spotguard:launch`` on the instance and its
volumes, and a ``ClientToken`` per attempt so a retried call never starts a second instance.

EC2 error codes are mapped here, once: capacity and price codes → :class:`CapacityError`
(fail over), auth and validation codes → :class:`PrecheckError` (give up).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import Field, field_validator

from spotguard.config import Settings
from spotguard.contracts import TAG_JOB, TAG_MANAGED, Assignment
from spotguard.errors import (
    CapacityError,
    PrecheckError,
    ProviderError,
    UnknownInstanceType,
)
from spotguard.providers.base import (
    TAG_LAUNCH,
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

#: Error codes meaning "not here, try elsewhere".
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientCapacity",
        "InsufficientHostCapacity",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "Unsupported",
    }
)
#: Error codes meaning "this request can never succeed as asked".
PRECHECK_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "OptInRequired",
        "InvalidParameterValue",
        "InvalidParameterCombination",
        "InvalidParameter",
        "MissingParameter",
        "IdempotentParameterMismatch",
        "InvalidLaunchTemplateName.NotFoundException",
        "InvalidLaunchTemplateId.NotFound",
        "InvalidLaunchTemplateId.Malformed",
        "InvalidAMIID.NotFound",
        "InvalidAMIID.Malformed",
        "InvalidSubnetID.NotFound",
    }
)
_NOT_FOUND = ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed")

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    "stopping": InstanceState.STOPPED,
    "stopped": InstanceState.STOPPED,
    "shutting-down": InstanceState.TERMINATED,
    "terminated": InstanceState.TERMINATED,
}


#: Placeholder of :attr:`AwsSettings.aws_launch_template` for the job name.
JOB_PLACEHOLDER = "{job}"
_PLACEHOLDER = re.compile(r"[^{}]+")


class AwsSettings(Settings):
    """Where and how the AWS provider launches instances."""

    section: ClassVar[str] = "aws"
    aws_regions: list[str] = Field(
        default_factory=lambda: ["us-east-1"],
        description="Regions to launch in, in failover order (the first is home)",
    )
    aws_launch_template: str | None = Field(
        None,
        description=(
            "Launch template name (or lt-... id) holding AMI, network, IAM profile; {job} is "
            "replaced by the job name (terraform/aws makes one per job: <name>-{job})"
        ),
    )
    aws_image_id: str | None = Field(None, description="AMI id, when not set by the template")
    aws_instance_types: list[str] = Field(
        default_factory=lambda: ["p*", "g*"],
        description="Instance type patterns the catalog lists (EC2 wildcards; GPU families)",
    )
    aws_subnets: dict[str, str] = Field(
        default_factory=dict, description="Subnet per availability zone (zone → subnet id)"
    )
    aws_endpoint_url: str | None = Field(
        None, description="EC2 endpoint override (tests, VPC endpoints); AWS_ENDPOINT_URL works too"
    )
    aws_poll_s: float = Field(5.0, gt=0, description="Seconds between instance state polls")
    aws_max_attempts: int = Field(
        3, ge=1, description="Attempts per EC2 call (botocore standard retry mode)"
    )

    @field_validator("aws_launch_template")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        if v is not None and _PLACEHOLDER.sub("", v.replace(JOB_PLACEHOLDER, "")):
            raise ValueError(f"{v!r}: the only placeholder a launch template may hold is {{job}}")
        return v

    def launch_template(self, job: str) -> dict[str, str] | None:
        """RunInstances' ``LaunchTemplate`` for ``job``: the setting with ``{job}`` replaced;
        an ``lt-…`` value is an id, anything else a name. ``None`` when none is set."""
        if not self.aws_launch_template:
            return None
        value = self.aws_launch_template.replace(JOB_PLACEHOLDER, job)
        key = "LaunchTemplateId" if value.startswith("lt-") else "LaunchTemplateName"
        return {key: value, "Version": "$Default"}


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def map_error(exc: BaseException, what: str) -> ProviderError:
    """One place that turns botocore errors into spotguard's provider errors."""
    code = _error_code(exc)
    msg = f"EC2 {what} failed: {code or type(exc).__name__}: {exc}"
    if code in CAPACITY_CODES:
        return CapacityError(msg)
    if code in PRECHECK_CODES or code.endswith(".NotFound") or code.startswith("Invalid"):
        return PrecheckError(msg)
    return ProviderError(msg)


def _tags(assignment: Assignment, round_token: str) -> list[dict[str, str]]:
    return [
        {"Key": TAG_MANAGED, "Value": "true"},
        {"Key": TAG_JOB, "Value": assignment.job},
        {"Key": TAG_LAUNCH, "Value": round_token},
        {"Key": "Name", "Value": f"spotguard-{assignment.job}"},
    ]


#: The catalog is stateless and slow to page through, so providers in one process share it:
#: (region, type patterns) → (fetched at, types). The catalog is EC2's, whatever the endpoint.
_CATALOG: dict[tuple[str, tuple[str, ...]], tuple[float, list[InstanceTypeInfo]]] = {}
CATALOG_TTL_S = 3600.0


class AwsProvider:
    """EC2 behind :class:`~spotguard.providers.base.CloudProvider`."""

    name = "aws"

    def __init__(self, settings: AwsSettings) -> None:
        self.settings = settings
        if not self.settings.aws_regions:
            raise PrecheckError("aws_regions is empty: name at least one region")
        self._clients: dict[str, Any] = {}
        self._lock = asyncio.Lock()

    def regions(self) -> list[str]:
        return list(self.settings.aws_regions)

    def _client(self, region: str) -> Any:
        if region not in self._clients:
            import boto3
            from botocore.config import Config

            retries = {"total_max_attempts": self.settings.aws_max_attempts, "mode": "standard"}
            self._clients[region] = boto3.session.Session().client(
                "ec2",
                region_name=region,
                endpoint_url=self.settings.aws_endpoint_url,
                config=Config(retries=retries),  # type: ignore[arg-type]
            )
        return self._clients[region]

    async def _call(self, region: str, what: str, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(client)`` in a thread; map any botocore error."""
        from botocore.exceptions import BotoCoreError, ClientError

        def run() -> Any:
            return fn(self._client(region))

        try:
            return await asyncio.to_thread(run)
        except ClientError as exc:
            raise map_error(exc, what) from exc
        except BotoCoreError as exc:
            raise ProviderError(f"EC2 {what} in {region} failed: {exc}") from exc

    # ----- catalog -----------------------------------------------------------------------

    async def instance_types(self, region: str | None = None) -> list[InstanceTypeInfo]:
        region = region or self.regions()[0]
        patterns = tuple(self.settings.aws_instance_types)
        key = (region, patterns)
        async with self._lock:
            cached = _CATALOG.get(key)
            if cached is None or time.monotonic() - cached[0] > CATALOG_TTL_S:

                def fetch(c: Any) -> list[dict[str, Any]]:
                    out: list[dict[str, Any]] = []
                    pages = c.get_paginator("describe_instance_types").paginate(
                        Filters=[{"Name": "instance-type", "Values": list(patterns)}]
                    )
                    for page in pages:
                        out.extend(page["InstanceTypes"])
                    return out

                raw = await self._call(region, "DescribeInstanceTypes", fetch)
                cached = (time.monotonic(), [_type_info(t) for t in raw])
                _CATALOG[key] = cached
        return cached[1]

    async def instance_type(self, name: str) -> InstanceTypeInfo:
        for t in await self.instance_types():
            if t.name == name:
                return t
        region = self.regions()[0]
        try:
            resp = await self._call(
                region,
                "DescribeInstanceTypes",
                lambda c: c.describe_instance_types(InstanceTypes=[name]),
            )
        except PrecheckError as exc:
            raise UnknownInstanceType(f"unknown EC2 instance type {name!r} in {region}") from exc
        if not resp.get("InstanceTypes"):
            raise UnknownInstanceType(f"unknown EC2 instance type {name!r} in {region}")
        return _type_info(resp["InstanceTypes"][0])

    async def offers(self, spec: LaunchSpec) -> list[Offer]:
        regions = [spec.target_region] if spec.target_region else self.regions()
        out: list[Offer] = []
        for region in regions:
            types = await self.instance_types(region)
            for extra in {spec.instance_type, spec.target_type} - {None, *(t.name for t in types)}:
                if extra is not None and spec.gpu_count == 0:
                    types = [*types, await self.instance_type(extra)]
            fit = [t for t in types if spec.mismatch(t) is None]
            if spec.target_type:
                fit = [t for t in fit if t.name == spec.target_type]
            if not fit:
                continue
            zones = await self._zones(region, [t.name for t in fit])
            out.extend(offers_from_catalog(self.name, region, spec, fit, zones))
        return out

    async def _zones(self, region: str, names: list[str]) -> dict[str, list[str]]:
        def fetch(c: Any) -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = []
            for i in range(0, len(names), 100):
                pages = c.get_paginator("describe_instance_type_offerings").paginate(
                    LocationType="availability-zone",
                    Filters=[{"Name": "instance-type", "Values": names[i : i + 100]}],
                )
                for page in pages:
                    rows.extend(page["InstanceTypeOfferings"])
            return rows

        zones: dict[str, list[str]] = {}
        for row in await self._call(region, "DescribeInstanceTypeOfferings", fetch):
            zones.setdefault(row["InstanceType"], []).append(row["Location"])
        return zones

    # ----- verbs -------------------------------------------------------------------------

    async def launch(
        self, offer: Offer, assignment: Assignment, *, client_token: str
    ) -> InstanceRef:
        s = self.settings
        round_token = round_of(client_token)
        tags = _tags(assignment, round_token)
        params: dict[str, Any] = {
            "MinCount": 1,
            "MaxCount": 1,
            "InstanceType": offer.instance_type,
            # botocore base64-encodes UserData for RunInstances, as EC2 requires.
            "UserData": assignment.user_data(),
            "ClientToken": client_token,
            "TagSpecifications": [
                {"ResourceType": "instance", "Tags": tags},
                {"ResourceType": "volume", "Tags": tags},
            ],
        }
        template = s.launch_template(assignment.job)
        what = "RunInstances"
        if template is not None:
            params["LaunchTemplate"] = template
            name = template.get("LaunchTemplateName") or template.get("LaunchTemplateId")
            what = f"RunInstances (launch template {name})"
        if s.aws_image_id:
            params["ImageId"] = s.aws_image_id
        if not s.aws_launch_template and not s.aws_image_id:
            raise PrecheckError("set aws_launch_template or aws_image_id to launch on EC2")
        if offer.zone in s.aws_subnets:
            params["SubnetId"] = s.aws_subnets[offer.zone]
        else:
            params["Placement"] = {"AvailabilityZone": offer.zone}
        if offer.market is Market.SPOT:
            params["InstanceMarketOptions"] = {
                "MarketType": "spot",
                "SpotOptions": {
                    "SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate",
                },
            }
        log.info(
            "launching",
            extra={"job": assignment.job, "offer": offer.label(), "client_token": client_token},
        )
        resp = await self._call(offer.region, what, lambda c: c.run_instances(**params))
        inst = resp["Instances"][0]
        return _ref(inst, offer.region, round_token)

    async def describe(self, ref: InstanceRef) -> InstanceRef:
        try:
            resp = await self._call(
                ref.region,
                "DescribeInstances",
                lambda c: c.describe_instances(InstanceIds=[ref.instance_id]),
            )
        except PrecheckError as exc:
            if any(code in str(exc) for code in _NOT_FOUND):
                return ref.with_state(InstanceState.TERMINATED)
            raise
        for r in resp.get("Reservations", []):
            for inst in r.get("Instances", []):
                return _ref(inst, ref.region, ref.launch_token)
        return ref.with_state(InstanceState.TERMINATED)

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
            await asyncio.sleep(self.settings.aws_poll_s)

    async def terminate(self, ref: InstanceRef) -> None:
        try:
            await self._call(
                ref.region,
                "TerminateInstances",
                lambda c: c.terminate_instances(InstanceIds=[ref.instance_id]),
            )
        except PrecheckError as exc:
            if not any(code in str(exc) for code in _NOT_FOUND):
                raise

    async def find_by_token(self, token: str) -> InstanceRef | None:
        filters = [
            {"Name": f"tag:{TAG_LAUNCH}", "Values": [token]},
            {
                "Name": "instance-state-name",
                "Values": ["pending", "running", "stopping", "stopped"],
            },
        ]
        for region in self.regions():
            resp = await self._call(
                region, "DescribeInstances", lambda c: c.describe_instances(Filters=filters)
            )
            for r in resp.get("Reservations", []):
                for inst in r.get("Instances", []):
                    return _ref(inst, region, token)
        return None

    async def aclose(self) -> None:
        for c in self._clients.values():
            close = getattr(c, "close", None)
            if close is not None:
                await asyncio.to_thread(close)
        self._clients.clear()


def _type_info(t: dict[str, Any]) -> InstanceTypeInfo:
    gpus = [g for g in t.get("GpuInfo", {}).get("Gpus", []) if g.get("Count", 0) > 0]
    gpu = gpus[0] if gpus else None
    mem = gpu.get("MemoryInfo", {}).get("SizeInMiB") if gpu else None
    archs = t.get("ProcessorInfo", {}).get("SupportedArchitectures", ["x86_64"])
    return InstanceTypeInfo(
        name=t["InstanceType"],
        gpu_model=canonical_gpu(gpu["Name"], mem) if gpu else None,
        gpu_count=sum(int(g["Count"]) for g in gpus),
        gpu_memory_mib=mem,
        vcpus=int(t.get("VCpuInfo", {}).get("DefaultVCpus", 0)),
        memory_mib=int(t.get("MemoryInfo", {}).get("SizeInMiB", 0)),
        arch=archs[0] if archs else "x86_64",
        spot="spot" in t.get("SupportedUsageClasses", ["spot"]),
    )


def _ref(inst: dict[str, Any], region: str, token: str | None) -> InstanceRef:
    tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
    spot = inst.get("InstanceLifecycle") == "spot"
    state = _STATES.get(inst.get("State", {}).get("Name", ""), InstanceState.PENDING)
    ended = state in (InstanceState.TERMINATED, InstanceState.STOPPED)
    why = inst.get("StateReason", {}).get("Message") if ended else None  # e.g. a spot reclaim
    return InstanceRef(
        provider="aws",
        instance_id=inst["InstanceId"],
        region=region,
        zone=inst.get("Placement", {}).get("AvailabilityZone", ""),
        instance_type=inst.get("InstanceType", ""),
        market=Market.SPOT if spot else Market.ON_DEMAND,
        launch_token=tags.get(TAG_LAUNCH, token),
        state=state,
        state_reason=str(why) if why else None,
    )
