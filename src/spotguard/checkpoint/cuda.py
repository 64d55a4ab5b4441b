"""GPU side of a checkpoint: the NVIDIA driver checkpoint API (by ctypes on libcuda) and the
GPU inventory (by NVML, ``nvidia-ml-py``).

The driver API (r570+) moves all device memory a process holds into that process's own host
memory and releases the GPU, so CRIU can dump it like any CPU process; restore moves it back.
Calls are made from this (the agent's) process, naming the job's pids::

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

Every call runs in a worker thread with a time limit (lock also has the driver's own
``timeoutMs``); calls for several processes run in parallel. A CPU-only job gets
:class:`NoGpu`, which does nothing. :func:`gpu_hook` picks one automatically.
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import logging
import threading
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from spotguard.errors import GpuError, StepTimeout
from spotguard.facts import GpuDevice, GpuInventory

from . import proctree

log = logging.getLogger(__name__)
T = TypeVar("T")


class GpuState(enum.IntEnum):
    """``CUprocessState`` as the driver reports it."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class GpuHook(Protocol):
    """What the engine needs from the GPU side. One implementation per kind of GPU stack."""

    async def gpu_pids(self, pids: Sequence[int]) -> list[int]:
        """Those of ``pids`` that hold GPU state."""
        ...

    async def state(self, pid: int) -> GpuState: ...

    async def lock(self, pids: Sequence[int], wait_s: float) -> None: ...

    async def checkpoint(self, pids: Sequence[int]) -> None: ...

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        """Bring GPU state back; ``remap`` maps image GPU UUIDs to this host's."""
        ...

    async def unlock(self, pids: Sequence[int]) -> None: ...

    def inventory(self) -> GpuInventory: ...

    def memory_used(self, pids: Sequence[int]) -> int:
        """Bytes of GPU memory the processes hold (0 when unknown)."""
        ...


class NoGpu:
    """The GPU hook of a CPU-only job or host: every step does nothing."""

    async def gpu_pids(self, pids: Sequence[int]) -> list[int]:
        return []

    async def state(self, pid: int) -> GpuState:
        return GpuState.RUNNING

    async def lock(self, pids: Sequence[int], wait_s: float) -> None:
        return None

    async def checkpoint(self, pids: Sequence[int]) -> None:
        return None

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        return None

    async def unlock(self, pids: Sequence[int]) -> None:
        return None

    def inventory(self) -> GpuInventory:
        return GpuInventory()

    def memory_used(self, pids: Sequence[int]) -> int:
        return 0


# --- driver API structures (cuda.h, CUDA 12.8+) -------------------------------------------


class _LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


class _GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", _Uuid), ("newUuid", _Uuid)]


class _RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(_GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (64 - ctypes.sizeof(ctypes.c_void_p) - 4)),
    ]


assert ctypes.sizeof(_LockArgs) == 64 and ctypes.sizeof(_RestoreArgs) == 64


def _uuid_bytes(text: str) -> _Uuid:
    """NVML's ``GPU-xxxxxxxx-...`` (or a bare UUID) as a CUuuid."""
    raw = uuidlib.UUID(text.removeprefix("GPU-")).bytes
    u = _Uuid()
    ctypes.memmove(u.bytes, raw, 16)
    return u


class _Driver:
    """libcuda.so.1, loaded once, ``cuInit(0)`` done."""

    _lock = threading.Lock()
    _instance: _Driver | None = None

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise GpuError(f"libcuda.so.1 not loadable: {exc}") from exc
        for name in (
            "cuCheckpointProcessLock",
            "cuCheckpointProcessCheckpoint",
            "cuCheckpointProcessRestore",
            "cuCheckpointProcessUnlock",
            "cuCheckpointProcessGetState",
        ):
            if not hasattr(self.lib, name):
                raise GpuError(f"the NVIDIA driver has no {name} (needs driver r570 or newer)")
        self._check(self.lib.cuInit(0), "cuInit")

    @classmethod
    def get(cls) -> _Driver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _error_string(self, code: int) -> str:
        msg = ctypes.c_char_p()
        if self.lib.cuGetErrorString(code, ctypes.byref(msg)) == 0 and msg.value:
            return msg.value.decode()
        return f"CUresult {code}"

    def _check(self, code: int, what: str, pid: int | None = None) -> None:
        if code != 0:
            who = f" (pid {pid})" if pid is not None else ""
            raise GpuError(f"{what}{who} failed: {self._error_string(code)} [{code}]")

    def state(self, pid: int) -> GpuState:
        st = ctypes.c_int(-1)
        self._check(
            self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(st)),
            "cuCheckpointProcessGetState",
            pid,
        )
        try:
            return GpuState(st.value)
        except ValueError:
            return GpuState.FAILED

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        self._check(
            self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)),
            "cuCheckpointProcessLock",
            pid,
        )

    def checkpoint(self, pid: int) -> None:
        self._check(
            self.lib.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", pid
        )

    def restore(self, pid: int, remap: Mapping[str, str] | None) -> None:
        if not remap:
            code = self.lib.cuCheckpointProcessRestore(pid, None)
        else:
            pairs = (_GpuPair * len(remap))()
            for i, (old, new) in enumerate(remap.items()):
                pairs[i].oldUuid = _uuid_bytes(old)
                pairs[i].newUuid = _uuid_bytes(new)
            args = _RestoreArgs(gpuPairs=pairs, gpuPairsCount=len(remap))
            code = self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        self._check(code, "cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", pid)


async def _each(pids: Sequence[int], call: Callable[[int], T], what: str, limit: float) -> list[T]:
    """Run ``call(pid)`` for every pid in parallel threads; each under ``limit`` seconds.

    All calls are awaited even if one fails (never leave a call running unobserved); the
    first failure is raised afterwards.
    """

    async def one(pid: int) -> T:
        try:
            return await asyncio.wait_for(asyncio.to_thread(call, pid), limit)
        except TimeoutError as exc:
            raise StepTimeout(f"{what} for pid {pid} ran past {limit:.0f} s") from exc

    results = await asyncio.gather(*(one(p) for p in pids), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if not isinstance(r, BaseException)]


class CudaHook:
    """The NVIDIA driver checkpoint API for the processes of a job."""

    def __init__(self, *, call_timeout: float = 300.0) -> None:
        self.call_timeout = call_timeout
        self._driver: Callable[[], _Driver] = _Driver.get

    async def gpu_pids(self, pids: Sequence[int]) -> list[int]:
        # A CUDA process keeps /dev/nvidia* open; after a checkpoint it holds none, so a
        # restored-but-locked process is found through the driver's state instead.
        found = [p for p in pids if proctree.uses_device(p, "/dev/nvidia")]
        return found

    async def state(self, pid: int) -> GpuState:
        drv = self._driver()
        return (await _each([pid], drv.state, "GPU state", self.call_timeout))[0]

    async def lock(self, pids: Sequence[int], wait_s: float) -> None:
        drv = self._driver()
        ms = max(int(wait_s * 1000), 1)
        await _each(pids, lambda p: drv.lock(p, ms), "GPU lock", wait_s + 5)

    async def checkpoint(self, pids: Sequence[int]) -> None:
        drv = self._driver()
        await _each(pids, drv.checkpoint, "GPU checkpoint", self.call_timeout)

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        drv = self._driver()
        await _each(pids, lambda p: drv.restore(p, remap), "GPU restore", self.call_timeout)

    async def unlock(self, pids: Sequence[int]) -> None:
        drv = self._driver()
        await _each(pids, drv.unlock, "GPU unlock", self.call_timeout)

    def inventory(self) -> GpuInventory:
        return inventory()

    def memory_used(self, pids: Sequence[int]) -> int:
        return _nvml_memory(pids)


def driver_available() -> bool:
    """True if libcuda loads, initialises and has the checkpoint API."""
    try:
        _Driver.get()
    except GpuError:
        return False
    return True


def gpu_hook(call_timeout: float = 300.0) -> GpuHook:
    """:class:`CudaHook` where the driver checkpoint API works, else :class:`NoGpu`."""
    if driver_available():
        return CudaHook(call_timeout=call_timeout)
    return NoGpu()


# --- NVML ----------------------------------------------------------------------------------


def _nvml() -> bool:
    """True once NVML is initialised; False without library, driver or GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library / no GPU / no driver all mean "no GPUs"
        return False
    return True


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def inventory() -> GpuInventory:
    """This host's GPUs (model, UUID, memory) and driver version; empty without a GPU."""
    if not _nvml():
        return GpuInventory()
    import pynvml

    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            devices.append(
                GpuDevice(
                    index=i,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                    model=_text(pynvml.nvmlDeviceGetName(h)),
                    memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                )
            )
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        return GpuInventory(devices=tuple(devices), driver=driver)
    except pynvml.NVMLError as exc:
        log.warning("NVML inventory failed", extra={"error": str(exc)})
        return GpuInventory()


def _nvml_memory(pids: Sequence[int]) -> int:
    if not _nvml():
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


async def call_all(calls: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Await every call even when one fails; raise the first failure after all are done."""
    results = await asyncio.gather(*(c() for c in calls), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
