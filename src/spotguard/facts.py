"""Facts about machines and GPUs, shared by images (manifest), agents (reports) and the
controller (matching). Plain frozen dataclasses with JSON round-trips."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as NVML sees it."""

    index: int
    uuid: str
    model: str  # e.g. "NVIDIA H100 80GB HBM3"
    memory_total: int  # bytes


@dataclass(frozen=True)
class GpuInventory:
    """The GPUs of a host (or those a job used) and the driver version."""

    devices: tuple[GpuDevice, ...] = ()
    driver: str | None = None  # e.g. "580.159.04"

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def model(self) -> str | None:
        """The model when all GPUs are the same (the only case restore supports)."""
        models = {d.model for d in self.devices}
        return models.pop() if len(models) == 1 else (None if not models else "mixed")

    @property
    def driver_major(self) -> int | None:
        if not self.driver:
            return None
        try:
            return int(self.driver.split(".")[0])
        except ValueError:
            return None

    @property
    def uuids(self) -> tuple[str, ...]:
        return tuple(d.uuid for d in self.devices)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "count": self.count,
            "driver": self.driver,
            "devices": [asdict(d) for d in self.devices],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> GpuInventory:
        if not data:
            return cls()
        return cls(
            devices=tuple(GpuDevice(**d) for d in data.get("devices", [])),
            driver=data.get("driver"),
        )


@dataclass(frozen=True)
class InstanceFacts:
    """Where a job runs: cloud, instance type, region/zone, instance id (all optional)."""

    provider: str = "local"
    instance_type: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_id: str | None = None
    spot: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> InstanceFacts:
        return cls(**data) if data else cls()


@dataclass(frozen=True)
class HostFacts:
    """Kernel, CPU architecture and memory of this host, and the CRIU version in use."""

    kernel: str
    arch: str
    memory_total: int
    criu_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostFacts:
        return cls(**data)

    @classmethod
    def probe(cls, criu_version: str | None = None) -> HostFacts:
        import psutil

        return cls(
            kernel=platform.release(),
            arch=platform.machine(),
            memory_total=int(psutil.virtual_memory().total),
            criu_version=criu_version,
        )
