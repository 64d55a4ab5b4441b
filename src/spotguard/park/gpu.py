"""What park needs to know about the GPUs, from NVML (``nvidia-ml-py``): free memory and each
process's SM utilisation. Both answer None / empty without a GPU, a driver or the library,
so the same code runs on CPU hosts (where a job's GPU side is simply idle)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

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
