"""GPU side of a checkpoint: the NVIDIA driver checkpoint API (through NVIDIA's ``cuda-core``)
and the GPU inventory (by NVML, ``nvidia-ml-py``).

The driver API (r570+) moves all device memory a process holds into that process's own host
memory and releases the GPU, so CRIU can dump it like any CPU process; restore moves it back.
Calls are made from this (the agent's) process, naming the job's pids::

    running --lock--> locked --checkpoint--> checkpointed --restore--> locked --unlock--> running

Every call runs in a worker thread with a time limit (lock also has the driver's own
``timeoutMs``); calls for several processes run in parallel. A CPU-only job gets
:class:`NoGpu`, which does nothing. :func:`gpu_hook` picks one automatically.

Locking several processes that talk to each other on the GPU (the ranks of an NCCL job) can
deadlock: a lock blocks the process's new launches and waits for the work it has submitted,
and a rank whose submitted collective waits for a peer that has not launched its half yet
never finishes while that peer is locked (``CUDA_ERROR_NOT_READY`` at the timeout). So the
lock of several processes is taken in short attempts: when one does not finish, every process
of the attempt is unlocked, the ranks run on and meet again (their next host sync), and the
lock is tried again after a short random pause, until ``wait_s`` is spent (measured on two
H200s: docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import enum
import importlib
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from spotguard import nvml
from spotguard.errors import GpuError, GpuUnsupportedError, StepTimeout
from spotguard.facts import GpuInventory

from .scan import MANAGED_FIX

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


# --- the driver checkpoint API, through NVIDIA's cuda-core ---------------------------------

NVIDIA_CTL = "/dev/nvidiactl"

#: cuda-core's state names → :class:`GpuState`
_STATES = {
    "running": GpuState.RUNNING,
    "locked": GpuState.LOCKED,
    "checkpointed": GpuState.CHECKPOINTED,
    "failed": GpuState.FAILED,
}


class CudaProcess(Protocol):
    """What spotguard uses of ``cuda.core.checkpoint.Process`` (a test double can stand in)."""

    @property
    def state(self) -> str: ...

    def lock(self, timeout_ms: int = 0) -> None: ...

    def checkpoint(self) -> None: ...

    def restore(self, gpu_mapping: Mapping[str, str] | None = None) -> None: ...

    def unlock(self) -> None: ...


def driver_uuid(nvml_uuid: str) -> str:
    """A GPU UUID as the checkpoint API takes it: NVML's ``GPU-8f3c…-…`` without the ``GPU-``
    prefix (cuda-core accepts the 32 hex digits, with or without hyphens, nothing else)."""
    return nvml_uuid.removeprefix("GPU-")


def _no_cuda_state(exc: Exception) -> bool:
    """True for the driver's answer about a process that has no CUDA context: a process that
    never initialised CUDA, or one forked from a CUDA process without exec (a DataLoader
    worker), which holds the parent's /dev/nvidia* descriptors but no context of its own."""
    text = str(exc)
    return "CUDA_ERROR_NOT_INITIALIZED" in text or "initialization error" in text


class _Driver:
    """The checkpoint API through ``cuda.core.checkpoint.Process`` (cuda-core 1.0+), which
    lays out each driver branch's argument structs (the restore arguments differ between
    r570 and r580+). ``cuInit`` is called once through ``cuda.bindings``: the driver wants it
    done in the calling process before a restore. (ctypes only asks the library whether it
    has a call: :func:`custom_storage_available`.)

    ``CUDA_VISIBLE_DEVICES`` is dropped from this (the agent's) environment before the
    driver starts: a restore must map every GPU the kernel-mode driver sees, and a mask on
    the caller would hide the GPUs a job is restored onto.
    """

    _lock = threading.Lock()
    _instance: _Driver | None = None

    def __init__(self, process: Callable[[int], CudaProcess] | None = None) -> None:
        if process is not None:
            self._process = process
            return
        if not os.path.exists(NVIDIA_CTL):
            # no NVIDIA kernel driver: say so before paying for cuda-core's import (1-2 s)
            raise GpuError(f"no NVIDIA driver on this host ({NVIDIA_CTL} is missing)")
        masked = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        if masked is not None:
            log.info(
                "ignoring CUDA_VISIBLE_DEVICES for the checkpoint API (restore needs every GPU)",
                extra={"gpus": masked},
            )
        try:
            bindings = importlib.import_module("cuda.bindings.driver")
            core = importlib.import_module("cuda.core.checkpoint")
        except ImportError as exc:
            raise GpuError(
                f"cuda-core is not installed ({exc}): pip install 'spotguard[gpu]'"
            ) from exc
        try:
            (err,) = bindings.cuInit(0)
        except (RuntimeError, OSError) as exc:  # no driver library (the loader says so)
            raise GpuError(f"the NVIDIA driver is not usable: {exc}") from exc
        if int(err) != 0:
            raise GpuError(f"cuInit failed: {err!r}")
        self._process = core.Process

    @classmethod
    def get(cls) -> _Driver:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _call(self, what: str, pid: int, call: Callable[[CudaProcess], T]) -> T:
        try:
            return call(self._process(pid))
        except Exception as exc:  # cuda-core's CUDAError derives from Exception
            raise GpuError(f"{what} (pid {pid}) failed: {exc}") from exc

    def state(self, pid: int) -> GpuState:
        name = self._call("cuCheckpointProcessGetState", pid, lambda p: p.state)
        return _STATES.get(str(name), GpuState.FAILED)

    def has_cuda(self, pid: int) -> bool:
        """True if the driver holds CUDA state for ``pid`` (running, locked, checkpointed)."""
        try:
            self._process(pid).state  # noqa: B018 - the driver call is the point
        except Exception as exc:  # noqa: BLE001 - cuda-core's CUDAError derives from Exception
            if not _no_cuda_state(exc):
                log.debug("no CUDA state", extra={"pid": pid, "error": str(exc)})
            return False
        return True

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("cuCheckpointProcessLock", pid, lambda p: p.lock(timeout_ms))

    def checkpoint(self, pid: int) -> None:
        """Move ``pid``'s GPU memory to host memory. The driver's CUDA_ERROR_NOT_SUPPORTED
        (managed memory, CUDA IPC it cannot move; the process stays locked, which the
        engine undoes) is final: :class:`GpuUnsupportedError` with what to change."""
        try:
            self._call("cuCheckpointProcessCheckpoint", pid, lambda p: p.checkpoint())
        except GpuError as exc:
            if "CUDA_ERROR_NOT_SUPPORTED" not in str(exc):
                raise
            raise GpuUnsupportedError(
                f"the NVIDIA driver cannot checkpoint the GPU state of pid {pid} "
                "(CUDA_ERROR_NOT_SUPPORTED): it holds CUDA managed (unified) memory or memory "
                f"shared with another process (CUDA IPC); {MANAGED_FIX}, and start NCCL jobs "
                "with 'spotguard run'"
            ) from exc

    def restore(self, pid: int, remap: Mapping[str, str] | None) -> None:
        mapping = {driver_uuid(o): driver_uuid(n) for o, n in (remap or {}).items()} or None
        self._call("cuCheckpointProcessRestore", pid, lambda p: p.restore(gpu_mapping=mapping))

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, lambda p: p.unlock())


#: seconds of one attempt at locking several GPU processes together
LOCK_ATTEMPT_S = 1.0


def _not_ready(exc: BaseException) -> bool:
    """True for a lock that ran out of time waiting for submitted work (or our own limit)."""
    return isinstance(exc, StepTimeout | TimeoutError) or "NOT_READY" in str(exc)


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

    def __init__(
        self, *, call_timeout: float = 300.0, driver: Callable[[], _Driver] | None = None
    ) -> None:
        self.call_timeout = call_timeout
        self._driver: Callable[[], _Driver] = driver or _Driver.get

    async def gpu_pids(self, pids: Sequence[int]) -> list[int]:
        """The processes the DRIVER says have CUDA state — not those holding /dev/nvidia*:
        forked DataLoader workers hold inherited descriptors but no context (the driver
        refuses to lock them), and a restored-but-locked process holds no descriptor yet."""
        drv = self._driver()
        found = await _each(pids, drv.has_cuda, "GPU state", self.call_timeout)
        return [p for p, yes in zip(pids, found, strict=True) if yes]

    async def state(self, pid: int) -> GpuState:
        drv = self._driver()
        return (await _each([pid], drv.state, "GPU state", self.call_timeout))[0]

    async def lock(self, pids: Sequence[int], wait_s: float) -> None:
        """Lock every process of ``pids``; several are locked together in attempts of at most
        :data:`LOCK_ATTEMPT_S` (see the module's docstring), never left half-locked."""
        drv = self._driver()
        if len(pids) < 2:
            ms = max(int(wait_s * 1000), 1)
            await _each(pids, lambda p: drv.lock(p, ms), "GPU lock", wait_s + 5)
            return
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            attempt += 1
            left = max(deadline - time.monotonic(), 0.001)
            ms = max(int(min(left, LOCK_ATTEMPT_S) * 1000), 1)
            results = await asyncio.gather(
                *(
                    asyncio.wait_for(asyncio.to_thread(drv.lock, p, ms), ms / 1000 + 5)
                    for p in pids
                ),
                return_exceptions=True,
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                if attempt > 1:
                    log.info("GPU lock taken", extra={"gpu_pids": list(pids), "attempt": attempt})
                return
            await self._release(pids)
            waiting = all(_not_ready(r) for r in failed)
            if not waiting or time.monotonic() >= deadline:
                if waiting:
                    raise GpuError(
                        f"GPU lock of {len(pids)} processes (pids {', '.join(map(str, pids))}) "
                        f"not taken in {wait_s:.0f} s ({attempt} attempts): work each had "
                        "submitted waited on another (ranks of one collective job that never "
                        "met at one step); the job runs on"
                    ) from failed[0]
                raise failed[0]
            await asyncio.sleep(random.uniform(0.005, 0.1))

    async def _release(self, pids: Sequence[int]) -> None:
        """Unlock every process of ``pids`` the driver reports locked (a failed attempt)."""
        drv = self._driver()
        states = await asyncio.gather(
            *(asyncio.wait_for(asyncio.to_thread(drv.state, p), self.call_timeout) for p in pids),
            return_exceptions=True,
        )
        locked = [p for p, st in zip(pids, states, strict=True) if st == GpuState.LOCKED]
        if locked:
            await _each(locked, drv.unlock, "GPU unlock", self.call_timeout)

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


#: the entry point of the driver's custom-storage checkpoint (CUDA 13.4's driver API): the
#: caller copies device memory itself, from mappings the driver hands it, instead of the
#: driver staging it in the process's host memory (docs/limits.md, "custom-storage")
CUSTOM_STORAGE_SYMBOL = "cuCheckpointOperationComplete"


def custom_storage_available(library: str = "libcuda.so.1") -> bool:
    """Whether this host's driver library has the custom-storage checkpoint. Asked of the
    library itself (a symbol lookup, no ``cuInit``): ``cuda.bindings`` has a wrapper for it
    wherever its own version knows the call, whatever the driver underneath has."""
    try:
        return hasattr(ctypes.CDLL(library), CUSTOM_STORAGE_SYMBOL)
    except OSError:  # no driver library on this host
        return False


@dataclass(frozen=True)
class Warmed:
    """What :func:`warm` loaded, and how long it took."""

    driver: bool
    nvml: bool
    seconds: float
    reason: str = ""  # why the driver is not usable ('' when it is)


def warm() -> Warmed:
    """Load the driver's checkpoint API and NVML now rather than at the first notice.

    cuda-core's import and ``cuInit`` take about half a second to two seconds, NVML's first
    init a few hundred milliseconds; on the first notice that time would come out of a 30 s
    warning (the agent calls this at start). Blocking: run it in a thread. Harmless without
    a GPU (says why in ``reason``)."""
    t0 = time.perf_counter()
    try:
        _Driver.get()
    except GpuError as exc:
        return Warmed(False, False, time.perf_counter() - t0, str(exc))
    return Warmed(True, nvml.available(), time.perf_counter() - t0)


def gpu_hook(call_timeout: float = 300.0) -> GpuHook:
    """:class:`CudaHook` where the driver checkpoint API works, else :class:`NoGpu`."""
    if driver_available():
        return CudaHook(call_timeout=call_timeout)
    return NoGpu()


# --- NVML (through spotguard.nvml) ---------------------------------------------------------


def inventory() -> GpuInventory:
    """This host's GPUs (model, UUID, memory) and driver version; empty without a GPU."""
    return nvml.inventory()


def _nvml_memory(pids: Sequence[int]) -> int:
    wanted = set(pids)
    return sum(p.used for p in nvml.processes() or () if p.pid in wanted)


async def call_all(calls: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Await every call even when one fails; raise the first failure after all are done."""
    results = await asyncio.gather(*(c() for c in calls), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
