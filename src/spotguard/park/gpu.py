"""What park needs to know about the GPUs, from NVML (through :mod:`spotguard.nvml`): free
memory and each process's SM utilisation. Both answer None / empty without a GPU, a driver or
the library, so the same code runs on CPU hosts (where a job's GPU side is simply idle)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from spotguard import nvml


def free_bytes() -> int | None:
    """Free memory summed over this host's GPUs; None without NVML."""
    found = nvml.gpus()
    return None if found is None else sum(g.memory_free for g in found)


def total_bytes() -> int | None:
    """Memory of this host's GPUs together; None without NVML."""
    found = nvml.gpus()
    return None if found is None else sum(g.memory_total for g in found)


def used_bytes(pids: Iterable[int]) -> int:
    """GPU memory the processes hold (0 without NVML)."""
    wanted = set(pids)
    return sum(p.used for p in nvml.processes() or () if p.pid in wanted)


def utilisation(pids: Iterable[int], since_us: int) -> float:
    """Highest SM utilisation (percent) NVML sampled for any of the processes since
    ``since_us`` (NVML's microsecond clock; 0 = whatever it still holds); 0 without NVML."""
    util = nvml.sm_utilisation(since_us) or {}
    return max((util[p] for p in set(pids) if p in util), default=0.0)


@dataclass(frozen=True)
class Device:
    """One GPU of this host as unpark sees it."""

    uuid: str
    model: str
    free: int


def devices() -> list[Device]:
    """This host's GPUs in index order, with free memory; empty without NVML."""
    return [Device(g.uuid, g.name, g.memory_free) for g in nvml.gpus() or ()]


def use_by_device(pids: Iterable[int]) -> dict[str, int]:
    """GPU UUID → bytes the processes hold on it (empty without NVML)."""
    wanted = set(pids)
    out: dict[str, int] = {}
    for p in nvml.processes() or ():
        if p.pid in wanted and p.used:
            out[p.gpu] = out.get(p.gpu, 0) + p.used
    return out


def choose(
    image: Sequence[Device], use: Mapping[str, int], host: Sequence[Device]
) -> list[str] | None:
    """Host GPUs (UUIDs, in the image's GPU order) to bring a parked job back onto.

    Each GPU the job used keeps its own GPU when that one has room for what the job held,
    else takes another of the same model with room (the driver remaps UUIDs); GPUs the job
    did not use are paired with what is left, so the driver gets a pair for every GPU it
    saw. None when the GPUs the job used cannot all get room (nothing is touched then).
    """
    left = {d.uuid: d for d in host}
    chosen: dict[str, str] = {}
    # most memory first, so a big user is not crowded out by a small one
    for img in sorted(image, key=lambda d: -use.get(d.uuid, 0)):
        need = use.get(img.uuid, 0)
        if not need:
            continue
        own = left.get(img.uuid)
        if own is not None and own.free >= need:
            pick = own
        else:
            fits = [d for d in left.values() if d.model == img.model and d.free >= need]
            if not fits:
                return None
            pick = max(fits, key=lambda d: d.free)
        chosen[img.uuid] = pick.uuid
        del left[pick.uuid]
    for img in image:
        if img.uuid in chosen:
            continue
        same = left.get(img.uuid) or next((d for d in left.values() if d.model == img.model), None)
        if same is None:
            return None
        chosen[img.uuid] = same.uuid
        del left[same.uuid]
    return [chosen[img.uuid] for img in image]
