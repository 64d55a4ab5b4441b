"""The GPU side of a container's checkpoint (podman, docker, containerd): the driver's
checkpoint API (:mod:`spotguard.checkpoint.cuda`, the same
:class:`~spotguard.checkpoint.cuda.GpuHook` a process job's engine uses) ordered around the
runtime's own checkpoint and restore.

Why spotguard's and not the runtime's: runc hands the container's processes to CRIU, which
cannot dump GPU memory; the driver can move it into each process's own host memory and give
the GPU up (no ``/dev/nvidia*`` descriptor or mapping stays), after which CRIU dumps the
process like any other. So, for the container's processes that the driver says hold CUDA
state::

    checkpoint: lock ─► checkpoint (GPU memory → host) ─► the runtime's checkpoint (CRIU)
                ─► leave-running / failed exit: the runtime's restore in place (docker,
                   podman; containerd's leave-running task just goes on) ─► restore ─► unlock
    restore:    the runtime's restore (CRIU) ─► restore (host → GPU) ─► unlock
    park (memory, podman's disk): lock ─► checkpoint ─► pause / podman checkpoint: GPU free
    unpark:     unpause / podman restore ─► restore ─► unlock

The runtimes differ only in how they are driven (``podman container checkpoint``,
``docker checkpoint create`` + ``docker start --checkpoint``, ``ctr tasks checkpoint`` +
``ctr containers restore``): the order above is the same for all three, and
:class:`ContainerGpu` needs of the runtime only the host pid of the container's init process
(:func:`for_container`: ``State.Pid`` of podman's and docker's inspect, the task's pid in
``ctr tasks ls``). After the runtime's restore the processes are new host pids; the driver
reports those it holds checkpointed, which is how they are found. A container with no GPU
process (or a host with no driver: :class:`~spotguard.checkpoint.cuda.NoGpu`) passes through
every step unchanged. The checkpoint records the host's GPUs (:attr:`ContainerGpu.inventory`,
in the image's container record); a restore maps them onto this host's as a process job's
restore does (:func:`spotguard.checkpoint.preflight.gpu_mapping`: same model and driver major,
at least as many GPUs, the same UUIDs kept, others in order) — refused before the runtime
creates anything when they do not match — and hands the pairs to the driver's restore. The
container's device nodes are its own (``--device /dev/nvidiaN``): a GPU in order on the new
host has the same index.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import GpuHook, GpuState, gpu_hook
from spotguard.checkpoint.preflight import gpu_mapping
from spotguard.container.containerd import Containerd
from spotguard.container.docker import Docker
from spotguard.container.podman import Podman
from spotguard.container.spec import ContainerRef
from spotguard.errors import GpuError, SpotguardError
from spotguard.facts import GpuInventory
from spotguard.timeline import Timeline
from spotguard.wirebase import GpuInfo

log = logging.getLogger(__name__)

#: how long the driver may take to lock a container's GPU processes (work in flight finishes)
LOCK_WAIT_S = 30.0


#: the host pid of a container's init process, asked of its runtime (0: it does not run)
InitPid = Callable[[], Awaitable[int]]


def for_container(runtime: Podman | Docker | Containerd, ref: ContainerRef) -> ContainerGpu:
    """The driver steps for the container ``ref`` of ``runtime``: its init process is
    ``State.Pid`` of podman's or docker's inspect, the pid of containerd's live task."""
    if isinstance(runtime, Containerd):
        ctrd = runtime

        async def init_pid() -> int:
            status, pid = await ctrd.task(ref)
            return pid if status in ("RUNNING", "PAUSED", "PAUSING") else 0

    else:
        inspect = runtime.inspect

        async def init_pid() -> int:
            ctr = await inspect(ref.name)
            return int(((ctr or {}).get("State") or {}).get("Pid") or 0)

    return ContainerGpu(init_pid, str(ref))


async def container_pids(init_pid: InitPid) -> list[int]:
    """The host pids of the container's processes (its init process and every descendant);
    none when it does not run."""
    pid = await init_pid()
    return proctree.tree(pid) if pid > 0 and proctree.alive(pid) else []


class ContainerGpu:
    """The driver steps for one container (``init_pid``: its init process's host pid, asked
    anew at each step; ``name``: the container, for logs; ``hook``: the driver, or nothing on
    a host without one)."""

    def __init__(self, init_pid: InitPid, name: str, hook: GpuHook | None = None) -> None:
        self.init_pid = init_pid
        self.name = name
        self.hook: GpuHook = hook if hook is not None else gpu_hook()
        self.frozen: list[int] = []
        #: GPU processes found already checkpointed (a container parked in memory): left so
        self.already: list[int] = []
        #: this host's GPUs, once a freeze found GPU state in the container (else empty)
        self.inventory = GpuInventory()

    def record(self) -> GpuInfo | None:
        """The GPUs for the image's container record (None: the container held none)."""
        return GpuInfo.model_validate(self.inventory.to_json()) if self.inventory.count else None

    def mapping(self, image: GpuInfo | None) -> dict[str, str]:
        """The image's GPUs → this host's (empty for an image without GPU state); raises
        :class:`~spotguard.errors.MismatchError` / ``PreflightError`` naming both sides."""
        if image is None or not image.devices:
            return {}
        return gpu_mapping(GpuInventory.from_json(image.model_dump()), self.hook.inventory())

    async def freeze(self, tl: Timeline) -> list[int]:
        """Lock the container's GPU processes and move their GPU memory into host memory;
        the pids frozen (empty: nothing to do). A failure unlocks what was locked and raises
        (:class:`~spotguard.errors.GpuError`): the container runs on."""
        pids = await container_pids(self.init_pid)
        cuda = await self.hook.gpu_pids(pids) if pids else []
        states = {p: await self.hook.state(p) for p in cuda}
        self.already = [p for p in cuda if states[p] is GpuState.CHECKPOINTED]
        gpu = [p for p in cuda if states[p] is GpuState.RUNNING]
        if cuda:
            self.inventory = self.hook.inventory()
        if not gpu:
            return []
        try:
            with tl.step("gpu_lock", pids=gpu):
                await self.hook.lock(gpu, LOCK_WAIT_S)
            with tl.step("gpu_checkpoint", pids=gpu):
                await self.hook.checkpoint(gpu)
        except BaseException:
            await self._undo(gpu)
            raise
        self.frozen = gpu
        return gpu

    async def _undo(self, pids: Sequence[int]) -> None:
        """Bring processes whose freeze failed back to running, whatever state each reached."""
        for pid in pids:
            try:
                state = await self.hook.state(pid)
                if state is GpuState.CHECKPOINTED:
                    await self.hook.restore([pid])
                    state = GpuState.LOCKED
                if state is GpuState.LOCKED:
                    await self.hook.unlock([pid])
            except GpuError as exc:
                log.error("GPU state not brought back", extra={"pid": pid, "error": str(exc)})

    async def thaw(self, tl: Timeline, remap: Mapping[str, str] | None = None) -> list[int]:
        """After the runtime has (re)started the container's processes from a checkpoint: move the
        GPU memory of those the driver holds checkpointed back onto the GPU (``remap``: the
        image's GPUs → this host's, :meth:`mapping`) and unlock them; the pids thawed."""
        pids = await container_pids(self.init_pid)
        cuda = await self.hook.gpu_pids(pids) if pids else []
        held = [p for p in cuda if await self.hook.state(p) is GpuState.CHECKPOINTED]
        if not held:
            return []
        with tl.step("gpu_restore", pids=held, remap=dict(remap or {})):
            await self.hook.restore(held, remap or None)
        with tl.step("gpu_unlock", pids=held):
            await self.hook.unlock(held)
        return held

    async def restored(
        self, tl: Timeline, remap: Mapping[str, str], remove: Callable[[], Awaitable[object]]
    ) -> list[int]:
        """:meth:`thaw` once the runtime has restored the container from an image. When the
        GPU state cannot come back, ``remove`` the new container and raise: its processes
        cannot run without their GPU memory and must not stay GPU-locked (as the engine kills
        a process tree restored without it); the image is still in the store, so the restore
        can be run again."""
        try:
            return await self.thaw(tl, remap)
        except SpotguardError:
            try:
                await remove()
            except SpotguardError as exc:
                extra = {"container": self.name, "error": str(exc)}
                log.error("container not removed", extra=extra)
            raise

    async def thaw_quietly(self, tl: Timeline) -> None:
        """:meth:`thaw` after a failed checkpoint: logged, never raised over the error that
        brought us here."""
        try:
            await self.thaw(tl)
        except SpotguardError as exc:
            extra = {"container": self.name, "error": str(exc)}
            log.error("GPU state not brought back", extra=extra)
