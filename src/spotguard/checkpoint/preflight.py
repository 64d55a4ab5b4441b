"""Restore preflight: refuse, before touching anything, an image this host cannot restore.

Checks, each failure naming both sides (:class:`~spotguard.errors.MismatchError`):
CPU architecture; CRIU version (this host's must be at least the image's); for GPU jobs the
driver checkpoint API, GPU model, GPU count and driver major version; free PIDs (a job
dumped in its own PID namespace needs none; one dumped without needs all its PIDs free);
and that the same job is not already running here. Returns the GPU UUID remap (image UUID →
host UUID) when the host's GPUs are other GPUs of the same model.
"""

from __future__ import annotations

from pathlib import Path

from spotguard.errors import MismatchError, PreflightError
from spotguard.facts import HostFacts

from . import proctree
from .criu import Criu
from .cuda import GpuHook, NoGpu
from .jobs import JobInfo, resolve_job
from .meta import ImageMeta


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


async def preflight(meta: ImageMeta, criu: Criu, gpu: GpuHook, state_dir: Path) -> dict[str, str]:
    """Raise :class:`PreflightError` / :class:`MismatchError` or return the GPU UUID remap."""
    host_criu = await criu.version()
    host = HostFacts.probe(host_criu)
    if host.arch != meta.host.arch:
        raise MismatchError("CPU architecture", meta.host.arch, host.arch)
    if _version_tuple(host_criu) < _version_tuple(meta.criu_version):
        raise MismatchError(
            "CRIU version (host must be at least the image's)", meta.criu_version, host_criu
        )
    remap: dict[str, str] = {}
    if meta.gpu_processes:
        if isinstance(gpu, NoGpu):
            raise PreflightError(
                "the image holds GPU state but this host has no usable NVIDIA driver "
                "checkpoint API (run 'spotguard doctor')"
            )
        inv = gpu.inventory()
        img = meta.gpu
        if img.model != inv.model:
            raise MismatchError("GPU model", img.model, inv.model)
        if img.count != inv.count:
            raise MismatchError("GPU count", img.count, inv.count)
        if img.driver_major != inv.driver_major:
            raise MismatchError("NVIDIA driver major version", img.driver, inv.driver)
        remap = {o: n for o, n in zip(img.uuids, inv.uuids, strict=True) if o != n}
    if meta.root_ns_pid != 1:
        taken = [p for p in meta.pids if proctree.alive(p)]
        if taken:
            raise PreflightError(
                f"the image's processes need PIDs {taken} which are in use here "
                "(jobs started with 'spotguard run' have their own PID namespace)"
            )
    name = str(meta.job.get("name", ""))
    try:
        existing: JobInfo | None = resolve_job(name, state_dir=state_dir)
    except Exception:  # noqa: BLE001 - any lookup failure means "no such job here"
        existing = None
    if existing is not None and proctree.alive(existing.pid) and _same_job(existing, meta):
        raise PreflightError(f"job {name!r} is already running here (pid {existing.pid})")
    return remap


def _same_job(existing: JobInfo, meta: ImageMeta) -> bool:
    return str(existing.dir) == str(meta.job.get("dir")) or existing.name == meta.job.get("name")
