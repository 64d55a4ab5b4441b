"""The one door to NVML (``nvidia-ml-py``, imported as ``pynvml``): the GPU inventory, free
memory, and what each process holds and computes on the GPUs.

NVML is initialised once per process, lazily (on the first query) and under a lock, so
threads of the agent may ask at the same time. It is never shut down: the library counts
initialisations, and a shutdown by one caller would pull NVML from under another. Without
the library, a driver or a GPU every query answers ``None`` ("unavailable") instead of
raising, so the same code runs on CPU hosts; that answer is kept for
:data:`RETRY_AFTER_S` seconds, then NVML is tried again (an agent started at boot may come up
before the NVIDIA driver is loaded). An NVML error in the middle of a query is logged and
answered with what was gathered before it (``None`` where a partial answer would mislead).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from spotguard.facts import GpuDevice, GpuInventory

log = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: Any = None  # the pynvml module once NVML is initialised
_tried_at: float | None = None  # monotonic time of the last failed initialisation
#: seconds an "unavailable" answer is kept before NVML is initialised again
RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class Gpu:
    """One GPU of this host, as NVML sees it now."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_free: int


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on one GPU and the memory it holds there (bytes)."""

    gpu: str  # the GPU's UUID
    pid: int
    used: int


def _text(v: object) -> str:
    """NVML strings are ``bytes`` in old bindings and ``str`` in new ones."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml() -> Any:
    """The initialised ``pynvml`` module, or None without library, driver or GPU."""
    global _lib, _tried_at
    with _lock:
        now = time.monotonic()
        if _lib is None and (_tried_at is None or now - _tried_at >= RETRY_AFTER_S):
            try:
                import pynvml

                pynvml.nvmlInit()
            except Exception as exc:  # noqa: BLE001 - no library / driver / GPU: "no GPUs here"
                _tried_at = now
                log.debug("no NVML", extra={"error": str(exc)})
            else:
                _lib = pynvml
        return _lib


def available() -> bool:
    """True where NVML works on this host (initialising it on first use)."""
    return _nvml() is not None


def gpus() -> list[Gpu] | None:
    """This host's GPUs in index order; None without NVML or when NVML fails."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append(
                Gpu(
                    index=i,
                    uuid=_text(nv.nvmlDeviceGetUUID(h)),
                    name=_text(nv.nvmlDeviceGetName(h)),
                    memory_total=int(mem.total),
                    memory_free=int(mem.free),
                )
            )
        return out
    except nv.NVMLError as exc:
        log.warning("NVML device query failed", extra={"error": str(exc)})
        return None


def driver_version() -> str | None:
    """The NVIDIA driver's version; None without NVML or when NVML fails."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        return _text(nv.nvmlSystemGetDriverVersion())
    except nv.NVMLError as exc:
        log.warning("NVML driver version failed", extra={"error": str(exc)})
        return None


def inventory() -> GpuInventory:
    """This host's GPUs (model, UUID, memory) and driver version, as facts record them;
    empty without NVML or when NVML fails."""
    found = gpus()
    driver = driver_version() if found is not None else None
    if found is None or driver is None:
        return GpuInventory()
    devices = tuple(
        GpuDevice(index=g.index, uuid=g.uuid, model=g.name, memory_total=g.memory_total)
        for g in found
    )
    return GpuInventory(devices=devices, driver=driver)


def processes() -> list[GpuProcess] | None:
    """Compute processes on every GPU with the memory each holds there (0 where NVML does not
    say); None without NVML, what was listed so far when NVML fails part way."""
    nv = _nvml()
    if nv is None:
        return None
    out: list[GpuProcess] = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nv.nvmlDeviceGetUUID(h))
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                out.append(GpuProcess(uuid, int(p.pid), int(p.usedGpuMemory or 0)))
    except nv.NVMLError as exc:
        log.warning("NVML could not list GPU processes", extra={"error": str(exc)})
    return out


def sm_utilisation(since_us: int) -> dict[int, float] | None:
    """pid → highest SM utilisation (percent) NVML sampled for it on any GPU since
    ``since_us`` (NVML's microsecond clock; 0 = whatever it still holds); None without NVML.
    A GPU with no samples in that period (idle) adds nothing."""
    nv = _nvml()
    if nv is None:
        return None
    best: dict[int, float] = {}
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            try:
                samples = nv.nvmlDeviceGetProcessUtilization(h, since_us)
            except nv.NVMLError_NotFound:
                continue
            for smp in samples:
                best[smp.pid] = max(best.get(smp.pid, 0.0), float(smp.smUtil))
    except nv.NVMLError as exc:
        log.debug("NVML utilisation failed", extra={"error": str(exc)})
    return best
