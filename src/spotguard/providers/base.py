"""The one protocol every cloud provider implements, and the typed data at its boundary.

A provider has two layers:

* a **catalog** — stateless facts: which instance types exist (GPU model, count and memory,
  vCPUs, memory, architecture) and in which zones they are offered
  (:meth:`CloudProvider.instance_types`, :meth:`CloudProvider.offers`);
* a few **verbs** with side effects: :meth:`~CloudProvider.launch`,
  :meth:`~CloudProvider.wait_ready`, :meth:`~CloudProvider.describe`,
  :meth:`~CloudProvider.terminate` and :meth:`~CloudProvider.find_by_token`.

Errors are typed so the controller decides without knowing the cloud:
:class:`~spotguard.errors.CapacityError` = fail over to the next offer,
:class:`~spotguard.errors.PrecheckError` = give up, :class:`~spotguard.errors.UnknownInstanceType`
and :class:`~spotguard.errors.NoMatchingOffer` = the request can't be met.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from spotguard.contracts import Assignment
from spotguard.facts import GpuInventory, InstanceFacts
from spotguard.providers.gpus import canonical_gpu

#: Tag (AWS) / label (GCP, with ``-`` for ``:``) carrying a launch round's idempotency token, so
#: a controller that restarts mid-launch finds the instance it already asked for.
TAG_LAUNCH = "spotguard:launch"
LABEL_LAUNCH = "spotguard-launch"


class Market(StrEnum):
    """How an instance is bought."""

    SPOT = "spot"
    ON_DEMAND = "on-demand"


class InstanceState(StrEnum):
    """Lifecycle of a launched instance, independent of the cloud's wording."""

    PENDING = "pending"
    RUNNING = "running"
    STOPPED = "stopped"
    TERMINATED = "terminated"


@dataclass(frozen=True)
class InstanceTypeInfo:
    """One catalog entry. ``gpu_model`` is canonical (:func:`canonical_gpu`)."""

    name: str
    gpu_model: str | None
    gpu_count: int
    gpu_memory_mib: int | None
    vcpus: int
    memory_mib: int
    arch: str = "x86_64"
    spot: bool = True

    def describe_gpus(self) -> str:
        return f"{self.gpu_count}x {self.gpu_model}" if self.gpu_count else "no GPU"


@dataclass(frozen=True)
class Offer:
    """An instance type offered in one zone, bought on one market."""

    provider: str
    region: str
    zone: str
    instance_type: str
    gpu_model: str | None
    gpu_count: int
    market: Market
    gpu_memory_mib: int | None = None
    vcpus: int = 0
    memory_mib: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Offer:
        return cls(**{**data, "market": Market(data["market"])})

    def label(self) -> str:
        return f"{self.instance_type}@{self.zone}/{self.market.value}"


@dataclass(frozen=True)
class LaunchSpec:
    """What a new instance must have to restore an image.

    Derived from the image's recorded facts (GPU inventory, host, instance). ``gpu_model`` is
    canonical; ``instance_type``/``region``/``zone`` are where the job ran last (preferences for
    strategies, not requirements). ``target_region``/``target_type`` come from a migration.
    """

    gpu_model: str | None = None
    gpu_count: int = 0
    driver_major: int | None = None
    arch: str | None = None
    min_memory_mib: int | None = None
    instance_type: str | None = None
    region: str | None = None
    zone: str | None = None
    target_region: str | None = None
    target_type: str | None = None

    @classmethod
    def from_facts(
        cls,
        gpu: GpuInventory,
        instance: InstanceFacts,
        host: dict[str, Any] | None = None,
        min_memory_mib: int | None = None,
    ) -> LaunchSpec:
        mem = gpu.devices[0].memory_total // (1024 * 1024) if gpu.devices else None
        return cls(
            gpu_model=canonical_gpu(gpu.model, mem) if gpu.count else None,
            gpu_count=gpu.count,
            driver_major=gpu.driver_major,
            arch=(host or {}).get("arch"),
            min_memory_mib=min_memory_mib,
            instance_type=instance.instance_type,
            region=instance.region,
            zone=instance.zone,
        )

    def retarget(
        self, *, region: str | None = None, instance_type: str | None = None
    ) -> LaunchSpec:
        return replace(self, target_region=region, target_type=instance_type)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> LaunchSpec:
        return cls(**data) if data else cls()

    def describe_gpus(self) -> str:
        return f"{self.gpu_count}x {self.gpu_model}" if self.gpu_count else "no GPU"

    def mismatch(self, t: InstanceTypeInfo) -> str | None:
        """Why ``t`` cannot restore this image (``None`` when it can)."""
        if self.gpu_count == 0 and t.gpu_count == 0:
            # CPU-only: keep to the type the job ran on unless a migration names another.
            wanted = self.target_type or self.instance_type
            if wanted and wanted != t.name:
                return f"CPU-only job stays on {wanted}"
        elif (t.gpu_model, t.gpu_count) != (self.gpu_model, self.gpu_count):
            return f"{t.name} has {t.describe_gpus()}, the image needs {self.describe_gpus()}"
        if self.arch and _arch(self.arch) != _arch(t.arch):
            return f"{t.name} is {t.arch}, the image is {self.arch}"
        if self.min_memory_mib and t.memory_mib < self.min_memory_mib:
            return f"{t.name} has {t.memory_mib} MiB memory, the job needs {self.min_memory_mib}"
        return None


def _arch(a: str) -> str:
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(a.lower(), a.lower())


@dataclass(frozen=True)
class InstanceRef:
    """A launched instance as the controller records it."""

    provider: str
    instance_id: str
    region: str
    zone: str
    instance_type: str
    market: Market
    launch_token: str | None = None
    state: InstanceState = InstanceState.PENDING
    extra: dict[str, Any] = field(default_factory=dict)
    #: why the instance stopped or ended, in one line, where the provider can tell (the local
    #: provider: the agent's exit status and its last error line); None: unknown or running
    state_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceRef:
        return cls(
            **{**data, "market": Market(data["market"]), "state": InstanceState(data["state"])}
        )

    def with_state(self, state: InstanceState) -> InstanceRef:
        return replace(self, state=state)

    def facts(self) -> InstanceFacts:
        return InstanceFacts(
            provider=self.provider,
            instance_type=self.instance_type,
            region=self.region,
            zone=self.zone,
            instance_id=self.instance_id,
            spot=self.market is Market.SPOT,
        )


def offers_from_catalog(
    provider: str,
    region: str,
    spec: LaunchSpec,
    types: list[InstanceTypeInfo],
    zones_by_type: dict[str, list[str]],
) -> list[Offer]:
    """Every (zone, type, market) in ``region`` that can restore ``spec``; preferred type first.

    Types are ordered: the type the job ran on (or a migration's target type), then smallest
    (memory, vCPUs, name). Markets: spot first where the type supports it, then on-demand.
    """
    fit = [t for t in types if spec.mismatch(t) is None]
    if spec.target_type:
        fit = [t for t in fit if t.name == spec.target_type]
    preferred = spec.target_type or spec.instance_type
    fit.sort(key=lambda t: (t.name != preferred, t.memory_mib, t.vcpus, t.name))
    out: list[Offer] = []
    for t in fit:
        for zone in sorted(zones_by_type.get(t.name, [])):
            markets = [Market.SPOT, Market.ON_DEMAND] if t.spot else [Market.ON_DEMAND]
            for m in markets:
                out.append(
                    Offer(
                        provider=provider,
                        region=region,
                        zone=zone,
                        instance_type=t.name,
                        gpu_model=t.gpu_model,
                        gpu_count=t.gpu_count,
                        market=m,
                        gpu_memory_mib=t.gpu_memory_mib,
                        vcpus=t.vcpus,
                        memory_mib=t.memory_mib,
                    )
                )
    return out


@runtime_checkable
class CloudProvider(Protocol):
    """A cloud (or this machine) that can run a job's next instance."""

    name: str

    def regions(self) -> list[str]:
        """Regions this provider may use, in configured order (the first is home)."""
        ...

    async def instance_types(self, region: str | None = None) -> list[InstanceTypeInfo]:
        """The catalog of instance types with their GPUs (stateless, cached)."""
        ...

    async def instance_type(self, name: str) -> InstanceTypeInfo:
        """One catalog entry; :class:`~spotguard.errors.UnknownInstanceType` if none."""
        ...

    async def offers(self, spec: LaunchSpec) -> list[Offer]:
        """Every offer in every configured region that can restore ``spec``."""
        ...

    async def launch(
        self, offer: Offer, assignment: Assignment, *, client_token: str
    ) -> InstanceRef:
        """Start one instance for ``offer`` whose boot restores ``assignment``.

        ``client_token`` makes the call idempotent: the same token never starts two instances,
        and the token's round prefix (before the last ``-``) is recorded on the instance so
        :meth:`find_by_token` finds it after a controller restart.
        """
        ...

    async def wait_ready(self, ref: InstanceRef, timeout_s: float) -> InstanceRef:
        """Wait until the instance runs (or raise :class:`~spotguard.errors.ProviderError`)."""
        ...

    async def describe(self, ref: InstanceRef) -> InstanceRef:
        """The instance's current state."""
        ...

    async def terminate(self, ref: InstanceRef) -> None:
        """Terminate (idempotent: an instance already gone is fine)."""
        ...

    async def find_by_token(self, token: str) -> InstanceRef | None:
        """The live instance launched in round ``token``, if any."""
        ...

    async def aclose(self) -> None:
        """Release clients and threads."""
        ...


def round_of(client_token: str) -> str:
    """The launch round of a per-attempt client token (``<round>-<attempt>``)."""
    return client_token.rsplit("-", 1)[0]
