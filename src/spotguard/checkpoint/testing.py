"""Test doubles for the checkpoint engine, public so users can test their own integrations.

:class:`RecordingGpu` behaves like the driver checkpoint API for chosen processes — the same
state machine (running → locked → checkpointed → locked → running), the same refusals of
out-of-order calls — without a GPU. It records every call, can be told to fail the first call
of one kind, and reports whether any process was left locked or checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from spotguard.errors import GpuError
from spotguard.facts import GpuDevice, GpuInventory

from .cuda import GpuState

FAKE_INVENTORY = GpuInventory(
    devices=(GpuDevice(0, "GPU-00000000-0000-0000-0000-000000000001", "Fake GPU 1GB", 1 << 30),),
    driver="580.0.0",
)


class RecordingGpu:
    """A GPU hook double. ``select`` picks which pids "hold GPU state" (default: the root)."""

    def __init__(
        self,
        select: Callable[[Sequence[int]], list[int]] | None = None,
        *,
        fail_on: str | None = None,
        inventory: GpuInventory = FAKE_INVENTORY,
        memory: int = 0,
    ) -> None:
        self.select = select or (lambda pids: list(pids[:1]))
        self.fail_on = fail_on
        self._inventory = inventory
        self.memory = memory
        self.states: dict[int, GpuState] = {}
        self.calls: list[tuple[str, int]] = []

    def _step(self, op: str, pid: int, need: GpuState, to: GpuState) -> None:
        self.calls.append((op, pid))
        if self.fail_on == op:
            self.fail_on = None  # a transient failure: the next call of that kind works
            raise GpuError(f"injected failure in GPU {op} (pid {pid})")
        # a process CRIU just restored from a GPU image holds its GPU state in host memory
        default = GpuState.CHECKPOINTED if op == "restore" else GpuState.RUNNING
        have = self.states.get(pid, default)
        if have is not need:
            raise GpuError(f"GPU {op} (pid {pid}) refused: process is {have.name.lower()}")
        self.states[pid] = to

    async def gpu_pids(self, pids: Sequence[int]) -> list[int]:
        return self.select(pids)

    async def state(self, pid: int) -> GpuState:
        self.calls.append(("state", pid))
        return self.states.get(pid, GpuState.RUNNING)

    async def lock(self, pids: Sequence[int], wait_s: float) -> None:
        for p in pids:
            self._step("lock", p, GpuState.RUNNING, GpuState.LOCKED)

    async def checkpoint(self, pids: Sequence[int]) -> None:
        for p in pids:
            self._step("checkpoint", p, GpuState.LOCKED, GpuState.CHECKPOINTED)

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        for p in pids:
            self._step("restore", p, GpuState.CHECKPOINTED, GpuState.LOCKED)

    async def unlock(self, pids: Sequence[int]) -> None:
        for p in pids:
            self._step("unlock", p, GpuState.LOCKED, GpuState.RUNNING)

    def inventory(self) -> GpuInventory:
        return self._inventory

    def memory_used(self, pids: Sequence[int]) -> int:
        return self.memory

    def stuck(self) -> dict[int, GpuState]:
        """Processes left locked or checkpointed (should be empty after any freeze)."""
        return {p: s for p, s in self.states.items() if s is not GpuState.RUNNING}
