"""Park settings: ``[park]`` keys, ``SPOTGUARD_PARK_*`` env vars, ``--flags``.

Where a parked job's state goes by default, and the agent's idle policy (all three signals —
GPU utilisation, CPU use of the tree, traffic on its TCP sockets — must stay under their
thresholds for ``idle_after`` seconds before a job counts as idle).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spotguard.config import Settings


class ParkSettings(Settings):
    """``[park]``: where parked state goes and when the agent parks an idle job."""

    section: ClassVar[str] = "park"
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_PARK_", extra="forbid", frozen=True, validate_default=True
    )

    to: str = Field(
        default="memory",
        description=(
            "Where a parked job's state goes: memory (tmpfs, fastest back), disk (the state "
            "dir), or a store URL (s3://, gs://, file://: can be unparked on another node)"
        ),
    )
    memory_dir: Path = Field(
        default=Path("/dev/shm/spotguard/parked"),
        description="Directory in memory (tmpfs) that holds jobs parked to memory",
    )
    idle_after: float = Field(
        default=0.0,
        ge=0,
        description="Park a protected job idle this many seconds (0: never park for idleness)",
    )
    sample_every: float = Field(
        default=10.0, gt=0, description="Seconds between two idleness samples of a job"
    )
    idle_cpu_percent: float = Field(
        default=2.0,
        ge=0,
        description="A job is CPU-idle below this use of one core by its whole tree (percent)",
    )
    idle_gpu_percent: float = Field(
        default=1.0, ge=0, description="A job is GPU-idle below this SM utilisation (percent)"
    )
    idle_bytes: int = Field(
        default=0,
        ge=0,
        description="A job is network-idle when its TCP sockets move at most this many bytes",
    )
    wake_on_connect: bool = Field(
        default=True,
        description="Jobs parked for idleness wake when a client connects to a port they had",
    )
    gpu_capacity_mib: int = Field(
        default=0,
        ge=0,
        description=(
            "GPU memory the priority scheduler may hand out (MiB; 0: the GPUs' total from NVML)"
        ),
    )
