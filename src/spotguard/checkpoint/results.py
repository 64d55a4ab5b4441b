"""What the engine hands back: :class:`FreezeResult` and :class:`RestoreResult`, and the
:class:`Mode` a freeze runs in (defined in :mod:`spotguard.contracts`: the same value travels
from the agent's policy to the reports).

Why a module of their own: the engine (:mod:`.engine`) is the one place that orders the steps
of a freeze and a restore; the shapes of their results are read by every caller
(:mod:`spotguard.operations`, the CLI, park) and do not order anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotguard.facts import GpuInventory, HostFacts
from spotguard.modes import Mode
from spotguard.timeline import Timeline

from .jobs import JobInfo
from .meta import ImageMeta
from .staging import StagingPlan

__all__ = ["PAUSE_STEPS", "FreezeResult", "Mode", "RestoreResult"]

#: the steps whose span is the job's pause (first one's start → last one's end)
PAUSE_STEPS = frozenset(
    {
        "nccl_release",
        "gpu_lock",
        "gpu_checkpoint",
        "criu_dump",
        "gpu_restore",
        "gpu_unlock",
        "nccl_rebuild",
    }
)


@dataclass
class FreezeResult:
    """A completed freeze: where the image is and how long each step took."""

    job: JobInfo
    images_dir: Path
    mode: Mode
    timeline: Timeline
    gpu: GpuInventory
    host: HostFacts
    staging: StagingPlan
    meta: ImageMeta
    gpu_pids: list[int] = field(default_factory=list)

    @property
    def pause_seconds(self) -> float:
        """How long the job could not run: first GPU/CRIU step start → last resume step end."""
        steps = [s for s in self.timeline.steps if s.name in PAUSE_STEPS and s.end is not None]
        if not steps:
            return 0.0
        return max(s.end or 0.0 for s in steps) - min(s.start for s in steps)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job.name,
            "pid": self.job.pid,
            "images_dir": str(self.images_dir),
            "mode": str(self.mode),
            "staging": self.staging.to_json(),
            "gpu_pids": self.gpu_pids,
            "pause_seconds": round(self.pause_seconds, 6),
            "timeline": self.timeline.to_list(),
        }


@dataclass
class RestoreResult:
    """A restored job: its new host pid and the restore's timeline (``image_url``: the image
    it came from, when that was a store URL; set by :func:`spotguard.operations.restore`)."""

    job: JobInfo
    pid: int
    timeline: Timeline
    meta: ImageMeta
    gpu_pids: list[int] = field(default_factory=list)
    image_url: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job.name,
            "pid": self.pid,
            "dir": str(self.job.dir),
            "gpu_pids": self.gpu_pids,
            "image_url": self.image_url,
            "gpu": self.meta.gpu.to_json(),
            "timeline": self.timeline.to_list(),
        }
