"""Priority on one node: a higher-priority job gets the GPU memory it needs by parking
lower-priority jobs (lowest first), and they come back when the GPU has room again.

A job's claim — its priority and the GPU memory it needs (``spotguard run --priority N
--gpu-memory SIZE``) — is kept in its job directory (``priority.json``), so it travels with
the job's image. The memory a running job holds is the larger of its claim and what NVML
measures; the node's capacity is ``[park] gpu_capacity_mib`` or the GPUs' total.

Example (capacity 80 GiB): ``notebook`` (priority 0) holds 30 GiB and ``server`` (priority
5) holds 40 GiB; ``train`` (priority 10) needs 40 GiB → free 10 < 40 → park ``notebook``
(lowest) → free 40 → enough; ``server`` keeps running. When ``train`` ends, ``notebook``'s
30 GiB fit again and the next reconcile unparks it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo
from spotguard.errors import SpotguardError

from . import gpu, record
from .record import ParkRecord

log = logging.getLogger(__name__)

CLAIM_FILE = "priority.json"
REASON = "priority"


@dataclass(frozen=True)
class Claim:
    """What a job asked for when it was started."""

    priority: int = 0
    gpu_bytes: int = 0


def claim_bytes(claim: Claim) -> bytes:
    """What ``priority.json`` holds for ``claim``."""
    data = {"priority": claim.priority, "gpu_bytes": claim.gpu_bytes}
    return (json.dumps(data) + "\n").encode()


def read_claim(job_dir: Path) -> Claim:
    try:
        data = json.loads((job_dir / CLAIM_FILE).read_text())
        return Claim(int(data.get("priority", 0)), int(data.get("gpu_bytes", 0)))
    except (OSError, ValueError, AttributeError):
        return Claim()


def held_bytes(job: JobInfo) -> int:
    """GPU memory a running job holds: its claim or what NVML measures, whichever is larger."""
    try:
        measured = gpu.used_bytes(proctree.tree(job.pid))
    except SpotguardError:
        measured = 0
    return max(read_claim(job.dir).gpu_bytes, measured)


ParkFn = Callable[[JobInfo, str], Awaitable[ParkRecord]]
UnparkFn = Callable[[str], Awaitable[object]]


async def make_room(
    need: Claim,
    running: Sequence[JobInfo],
    capacity: int,
    park: ParkFn,
    *,
    for_job: str = "a new job",
) -> list[str]:
    """Park lower-priority jobs, lowest first, until ``need.gpu_bytes`` fits; the names parked.

    Jobs of equal or higher priority are never parked; when parking every lower one is not
    enough, nothing is parked at all (no job is stopped for nothing).
    """
    if need.gpu_bytes and not capacity:
        log.warning(
            "no GPU memory known on this node (no GPU that NVML sees, no [park] "
            "gpu_capacity_mib): nothing parked to make room",
            extra={"job": for_job, "need_bytes": need.gpu_bytes},
        )
        return []
    held = {j.name: held_bytes(j) for j in running}
    free = capacity - sum(held.values())
    if need.gpu_bytes <= free:
        return []
    lower = sorted(
        (j for j in running if read_claim(j.dir).priority < need.priority),
        key=lambda j: (read_claim(j.dir).priority, -held[j.name]),
    )
    chosen: list[JobInfo] = []
    for job in lower:
        if free >= need.gpu_bytes:
            break
        chosen.append(job)
        free += held[job.name]
    if free < need.gpu_bytes:
        log.warning(
            "not enough GPU memory even after parking every lower-priority job",
            extra={"job": for_job, "need_bytes": need.gpu_bytes, "free_bytes": max(0, free)},
        )
        return []
    parked = []
    for job in chosen:
        why = f"{REASON}: {for_job} (priority {need.priority}) needs the GPU"
        await park(job, why)
        parked.append(job.name)
    return parked


async def bring_back(
    state_dir: Path,
    running: Sequence[JobInfo],
    capacity: int,
    unpark: UnparkFn,
) -> list[str]:
    """Unpark jobs parked for priority, highest priority first, while their memory fits."""
    free = capacity - sum(held_bytes(j) for j in running)
    waiting = [r for r in record.all_records(state_dir) if r.reason.startswith(REASON)]
    waiting.sort(key=lambda r: (-r.priority, r.since))
    back = []
    for rec in waiting:
        need = max(rec.gpu_bytes_freed, read_claim(Path(rec.job_dir)).gpu_bytes)
        if need > free:
            continue
        try:
            await unpark(rec.job)
        except SpotguardError as exc:
            log.warning("could not unpark", extra={"job": rec.job, "error": str(exc)})
            continue
        free -= need
        back.append(rec.job)
    return back


def capacity_bytes(capacity_mib: int) -> int:
    """The node's GPU memory for the scheduler: the setting, else NVML's total, else 0."""
    if capacity_mib:
        return capacity_mib * 2**20
    return gpu.total_bytes() or 0
