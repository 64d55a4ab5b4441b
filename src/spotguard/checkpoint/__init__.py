"""Freeze and restore jobs: CRIU for the process tree, the NVIDIA driver API for the GPU.

Public surface (everything else is private to the package)::

    jobs.start_job / resolve_job / JobInfo      checkpointable jobs (``spotguard run``)
    criu.Criu                                   the CRIU driver
    cuda.GpuHook, CudaHook, NoGpu, gpu_hook, inventory
    engine.Engine, Faults                       the one place that orders freeze/restore steps
    results.Mode, FreezeResult, RestoreResult   what they return
    marker.FreezeMarker, MARKER                 the crash marker (operation.json)
    targets.DumpTarget, RestoreSource, DirectoryTarget, DirectorySource, StagingPlan
    meta.ImageMeta, META_NAME                   ``spotguard-image.json``
    settings.CheckpointSettings                 ``[checkpoint]`` settings
    testing.RecordingGpu                        a GPU hook test double
"""

from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import CudaHook, GpuHook, GpuState, NoGpu, gpu_hook, inventory
from spotguard.checkpoint.engine import Engine, Faults
from spotguard.checkpoint.jobs import JobInfo, resolve_job, start_job
from spotguard.checkpoint.meta import META_NAME, ImageMeta
from spotguard.checkpoint.results import FreezeResult, Mode, RestoreResult
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import (
    DirectorySource,
    DirectoryTarget,
    DumpTarget,
    RestoreSource,
    StagingPlan,
)

__all__ = [
    "META_NAME",
    "CheckpointSettings",
    "Criu",
    "CudaHook",
    "DirectorySource",
    "DirectoryTarget",
    "DumpTarget",
    "Engine",
    "Faults",
    "FreezeResult",
    "GpuHook",
    "GpuState",
    "ImageMeta",
    "JobInfo",
    "Mode",
    "NoGpu",
    "RestoreResult",
    "RestoreSource",
    "StagingPlan",
    "gpu_hook",
    "inventory",
    "resolve_job",
    "start_job",
]
