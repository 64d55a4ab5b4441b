"""Restore preflight: refuse, before touching anything, an image this host cannot restore.

Checks, each failure naming both sides (:class:`~spotguard.errors.MismatchError`):
CPU architecture; CRIU version (this host's must be at least the image's); for GPU jobs the
driver checkpoint API, GPU model, GPU count and driver major version; every host mount the
job uses (:func:`.mounts.check`: MissingMount names the first one absent); and that the same
job is not already running here. Returns the GPU mapping (image UUID → host UUID) for the
driver's restore.

GPU mapping (:func:`gpu_mapping`): the driver's restore must be given a pair for EVERY GPU
of the image — every GPU the kernel-mode driver saw at the checkpoint, whatever the job's
``CUDA_VISIBLE_DEVICES`` hid from it (the image records them all). A host with the same GPUs
maps each onto itself; a host with other GPUs of the same model maps them in order; a host
with MORE GPUs than the image uses a subset: the ``restore_gpus`` setting, else the image's
own UUIDs where present, else the first ones. Remapping needs driver r580+ (the r570 restore
arguments have no GPU pairs); on r570 only a same-GPU restore is possible.

PIDs (:func:`wait_pids_free`): a job dumped in its own PID namespace needs no particular PID
here. One dumped without (``--no-pid-namespace``) needs all its PIDs free: restore waits
while they are held by processes on their way out (a just-killed job's zombies, a process
still releasing its GPU) and refuses at once, naming them, when a live process holds one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotguard.errors import MismatchError, PreflightError
from spotguard.facts import GpuDevice, GpuInventory, HostFacts

from . import mounts
from .criu import Criu
from .cuda import GpuHook, NoGpu
from .jobs import JobInfo, resolve_job
from .meta import ImageMeta

#: the first driver branch whose restore takes GPU pairs (restore onto other GPUs)
REMAP_DRIVER_MAJOR = 580
_PF_EXITING = 0x4


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def _describe(inv: GpuInventory) -> str:
    return f"{inv.count} x {inv.model}" if inv.count else "no GPU"


def _pick(host: GpuInventory, wanted: str) -> GpuDevice:
    """The host GPU named by an index or a UUID (with or without NVML's ``GPU-``)."""
    w = wanted.strip()
    for d in host.devices:
        if w.isdigit() and int(w) == d.index:
            return d
        if w.removeprefix("GPU-").lower() == d.uuid.removeprefix("GPU-").lower():
            return d
    have = ", ".join(f"{d.index}={d.uuid}" for d in host.devices)
    raise PreflightError(f"restore_gpus names GPU {w!r}, which this host lacks (it has {have})")


def gpu_mapping(
    image: GpuInventory, host: GpuInventory, chosen: Sequence[str] | None = None
) -> dict[str, str]:
    """The image's GPUs → this host's (every image GPU, identity pairs included), or raise
    :class:`MismatchError` / :class:`PreflightError` naming both sides."""
    if image.model != host.model:
        raise MismatchError("GPU model", image.model, host.model)
    if host.count < image.count:
        raise MismatchError(
            "GPU count (the host needs at least the image's GPUs)",
            _describe(image),
            _describe(host),
        )
    if image.driver_major != host.driver_major:
        raise MismatchError("NVIDIA driver major version", image.driver, host.driver)
    if chosen:
        targets = [_pick(host, c) for c in chosen]
        if len(targets) != image.count:
            raise MismatchError(
                "GPU count (restore_gpus must name one host GPU per image GPU)",
                _describe(image),
                f"{len(targets)} chosen: {', '.join(chosen)}",
            )
        if len({t.uuid for t in targets}) != len(targets):
            raise PreflightError(f"restore_gpus names a GPU twice: {', '.join(chosen)}")
    else:
        present = {d.uuid for d in host.devices}
        kept = [u for u in image.uuids if u in present]
        spare = iter(d for d in host.devices if d.uuid not in kept)
        targets = [
            next(d for d in host.devices if d.uuid == u) if u in present else next(spare)
            for u in image.uuids
        ]
    mapping = {old: t.uuid for old, t in zip(image.uuids, targets, strict=True)}
    moved = {o: n for o, n in mapping.items() if o != n}
    if (host.driver_major or 0) < REMAP_DRIVER_MAJOR:
        if moved:
            raise MismatchError(
                f"GPUs (restoring onto other GPUs needs driver r{REMAP_DRIVER_MAJOR}+)",
                sorted(moved),
                f"{sorted(moved.values())} with driver {host.driver}",
            )
        return {}  # r570's restore takes no pairs: a same-GPU restore needs none
    return mapping


async def preflight(
    meta: ImageMeta,
    criu: Criu,
    gpu: GpuHook,
    state_dir: Path,
    *,
    restore_gpus: str | None = None,
) -> dict[str, str]:
    """Raise :class:`PreflightError` / :class:`MismatchError` or return the GPU mapping."""
    host_criu = await criu.version()
    host = HostFacts.probe(host_criu)
    if host.arch != meta.host.arch:
        raise MismatchError("CPU architecture", meta.host.arch, host.arch)
    if _version_tuple(host_criu) < _version_tuple(meta.criu_version):
        raise MismatchError(
            "CRIU version (host must be at least the image's)", meta.criu_version, host_criu
        )
    if meta.mount_ns:
        # a mount the job uses, absent here: refused now, before anything is restored
        mounts.check(meta.mounts, job=str(meta.job.get("name", "")))
    mapping: dict[str, str] = {}
    if meta.gpu_processes:
        if isinstance(gpu, NoGpu):
            raise PreflightError(
                "the image holds GPU state but this host has no usable NVIDIA driver "
                "checkpoint API (run 'spotguard doctor')"
            )
        chosen = [c for c in (restore_gpus or "").split(",") if c.strip()] or None
        mapping = gpu_mapping(meta.gpu, gpu.inventory(), chosen)
    if (pid := already_running(meta.job, state_dir)) is not None:
        raise PreflightError(f"job {meta.job.get('name')!r} is already running here (pid {pid})")
    return mapping


def already_running(job: Mapping[str, Any], state_dir: Path) -> int | None:
    """The pid of the image's job (``job``: its record in the image) where it runs here now,
    by its record in ``state_dir`` — pid and start time: a stranger given the job's old pid
    is not the job — else None."""
    name = str(job.get("name", ""))
    try:
        existing: JobInfo | None = resolve_job(name, state_dir=state_dir)
    except Exception:  # noqa: BLE001 - any lookup failure means "no such job here"
        existing = None
    if existing is None or not existing.running():
        return None
    same = str(existing.dir) == str(job.get("dir")) or existing.name == job.get("name")
    return existing.pid if same else None


@dataclass(frozen=True)
class PidHolder:
    """A process holding a PID an image needs."""

    pid: int
    name: str
    leaving: bool  # a zombie, or exiting (e.g. still releasing its GPU)

    def __str__(self) -> str:
        return f"{self.pid} ({self.name}{', exiting' if self.leaving else ''})"


def pid_holder(pid: int) -> PidHolder | None:
    """Who holds ``pid`` here (zombies included), or None when it is free."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    state, flags = fields[0], int(fields[6])
    return PidHolder(pid, name, state in ("Z", "X") or bool(flags & _PF_EXITING))


async def wait_pids_free(pids: Sequence[int], limit: float, *, grace: float = 3.0) -> float:
    """Wait until no process holds any of ``pids``; the seconds waited.

    A holder on its way out (zombie, exiting) is waited for up to ``limit`` seconds; a live
    one only ``grace`` seconds (a process killed a moment ago may not look dead yet), then
    :class:`PreflightError` names it.
    """
    start = time.monotonic()
    while True:
        held = [h for h in (pid_holder(p) for p in pids) if h is not None]
        waited = time.monotonic() - start
        if not held:
            return waited
        live = [h for h in held if not h.leaving]
        if (live and waited > grace) or waited > limit:
            who = ", ".join(str(h) for h in held)
            raise PreflightError(
                f"the image's processes need PIDs held here by {who} (waited {waited:.0f} s): "
                "a job started with --no-pid-namespace needs its exact PIDs; jobs in their "
                "own PID namespace (the default) need none"
            )
        await asyncio.sleep(0.1)
