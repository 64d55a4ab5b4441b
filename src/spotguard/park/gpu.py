"""What park needs to know about the GPUs, from NVML (``nvidia-ml-py``): free memory and each
process's SM utilisation. Both answer None / empty without a GPU, a driver or the library,
so the same code runs on CPU hosts (where a job's GPU side is simply idle)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


def _init() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library / driver / GPU all mean "no GPUs here"
        return False
    return True


def free_bytes() -> int | None:
    """Free memory summed over this host's GPUs; None without NVML."""
    if not _init():
        return None
    import pynvml

    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            total += int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
        return total
    except pynvml.NVMLError as exc:
        log.warning("NVML free memory failed", extra={"error": str(exc)})
        return None


def total_bytes() -> int | None:
    """Memory of this host's GPUs together; None without NVML."""
    if not _init():
        return None
    import pynvml

    try:
        return sum(
            int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total)
            for i in range(pynvml.nvmlDeviceGetCount())
        )
    except pynvml.NVMLError:
        return None


def used_bytes(pids: Iterable[int]) -> int:
    """GPU memory the processes hold (0 without NVML)."""
    if not _init():
        return 0
    import pynvml

    wanted = set(pids)
    total = 0
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in wanted and p.usedGpuMemory:
                    total += int(p.usedGpuMemory)
    except pynvml.NVMLError:
        return total
    return total


def utilisation(pids: Iterable[int], since_us: int) -> float:
    """Highest SM utilisation (percent) NVML sampled for any of the processes since
    ``since_us`` (NVML's microsecond clock; 0 = whatever it still holds); 0 without NVML."""
    if not _init():
        return 0.0
    import pynvml

    wanted = set(pids)
    best = 0.0
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                samples = pynvml.nvmlDeviceGetProcessUtilization(h, since_us)
            except pynvml.NVMLError_NotFound:
                continue  # no samples in that period: idle
            for smp in samples:
                if smp.pid in wanted:
                    best = max(best, float(smp.smUtil))
    except pynvml.NVMLError as exc:
        log.debug("NVML utilisation failed", extra={"error": str(exc)})
    return best


@dataclass(frozen=True)
class Device:
    """One GPU of this host as unpark sees it."""

    uuid: str
    model: str
    free: int


def devices() -> list[Device]:
    """This host's GPUs in index order, with free memory; empty without NVML."""
    if not _init():
        return []
    import pynvml

    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                Device(
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    model=name.decode() if isinstance(name, bytes) else str(name),
                    free=int(pynvml.nvmlDeviceGetMemoryInfo(h).free),
                )
            )
    except pynvml.NVMLError:
        return []
    return out


def use_by_device(pids: Iterable[int]) -> dict[str, int]:
    """GPU UUID → bytes the processes hold on it (empty without NVML)."""
    if not _init():
        return {}
    import pynvml

    wanted = set(pids)
    out: dict[str, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(h)
            key = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid in wanted and p.usedGpuMemory:
                    out[key] = out.get(key, 0) + int(p.usedGpuMemory)
    except pynvml.NVMLError:
        return out
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
