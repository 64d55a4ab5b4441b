"""What one ``spotguard demo`` run does: the scenario's knobs, checked before anything starts.

These are options of one run, not settings of a long-lived part, so they are plain command
flags and not a :class:`~spotguard.config.Settings` group: a ``SPOTGUARD_STORE`` in the
environment names the agent's store and must not be read as the demo's ``--store`` choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from spotguard.errors import ConfigError
from spotguard.simulator.state import CATALOG

Cloud = Literal["aws", "gcp", "azure"]
Kind = Literal["preempt", "rebalance", "maintenance"]
StoreKind = Literal["file", "s3"]
Fault = Literal["store", "launch", "restore", "notices"]

CLOUDS: tuple[Cloud, ...] = ("aws", "gcp", "azure")
KINDS: tuple[Kind, ...] = ("preempt", "rebalance", "maintenance")
STORES: tuple[StoreKind, ...] = ("file", "s3")
FAULTS: tuple[Fault, ...] = ("store", "launch", "restore", "notices")

#: Seconds between a maintenance notice and its event. Under the agent's default lead
#: (``maintenance_lead`` = 300 s) the checkpoint starts at once, as it would minutes before a
#: real event.
MAINTENANCE_IN_S = 120.0

JOB_NAME = "train"


@dataclass(frozen=True)
class DemoOptions:
    """One demo run. ``drain`` replaces the cloud notice by an operator drain."""

    cloud: Cloud = "aws"
    kind: Kind = "preempt"
    drain: bool = False
    store: StoreKind = "file"
    steps: int = 60
    step_seconds: float = 0.1
    mb: int = 32
    seed: int = 1234
    gpu: Literal["auto", "yes", "no"] = "auto"
    notice_at: int | None = None  # the step after which the notice comes (default: steps // 3)
    workdir: Path | None = None
    keep: bool = False
    fault: Fault | None = None
    stage_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.cloud not in CLOUDS:
            raise ConfigError(f"--cloud must be one of {', '.join(CLOUDS)}, got {self.cloud!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"--kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.drain and (self.cloud, self.kind) not in CATALOG:
            has = sorted(k for c, k in CATALOG if c == self.cloud)
            raise ConfigError(
                f"{self.cloud} sends no {self.kind!r} notices (it has {', '.join(has)}); "
                "rebalance recommendations are AWS only"
            )
        if self.steps < 6:
            raise ConfigError("--steps must be at least 6 (the notice comes mid-run)")
        if self.step_seconds < 0.02:
            raise ConfigError("--step-seconds must be at least 0.02 (time to send the notice)")
        if self.mb < 1:
            raise ConfigError("--mb must be at least 1")
        if self.notice_at is not None and not 1 <= self.notice_at < self.steps - 2:
            raise ConfigError(f"--notice-at must be between 1 and {self.steps - 3}")
        if self.stage_timeout <= 0:
            raise ConfigError("--stage-timeout must be positive")

    @property
    def notice_step(self) -> int:
        """The step the job must have printed before the notice is sent."""
        return self.notice_at if self.notice_at is not None else max(1, self.steps // 3)

    @property
    def relaunches(self) -> bool:
        """True when the job must continue on VM 2 (a rebalance resumes it on VM 1)."""
        return self.drain or self.kind != "rebalance"

    @property
    def notice_label(self) -> str:
        if self.drain:
            return "operator drain through the agent's local API"
        return f"{self.cloud} {self.kind} notice"

    def job_args(self, *, step_seconds: float | None = None) -> list[str]:
        """Arguments of the sample job (``spotguard.demo.job``)."""
        return [
            "--steps",
            str(self.steps),
            "--step-seconds",
            str(self.step_seconds if step_seconds is None else step_seconds),
            "--mb",
            str(self.mb),
            "--seed",
            str(self.seed),
            "--gpu",
            self.gpu,
        ]

    def notice_in_seconds(self) -> float | None:
        """Seconds until the injected event (None: the cloud's usual warning time)."""
        return MAINTENANCE_IN_S if self.kind == "maintenance" else None
