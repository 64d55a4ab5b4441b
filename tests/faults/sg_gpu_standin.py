"""The GPU stand-in for kill tests: :class:`~spotguard.checkpoint.testing.RecordingGpu`'s
state machine (running → locked → checkpointed → locked → running, out-of-order calls
refused) with its states kept in a JSON file, so that they outlive the process that drove
them — as the driver's do when the process running a park is killed. ``pause_after``: once
that call (``lock``, ``checkpoint``, ``restore``, ``unlock``) has succeeded, print
``after <call>`` and wait, so a test can SIGKILL the process at that instant.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from spotguard.checkpoint.cuda import GpuState
from spotguard.checkpoint.testing import RecordingGpu


class FileGpu(RecordingGpu):
    """A GPU hook double whose per-process states live in ``path``. ``with_gpu``: the root of
    the tree holds GPU state (else the job is a CPU job: no GPU processes)."""

    def __init__(self, path: Path, *, with_gpu: bool = True, pause_after: str | None = None):
        super().__init__(None if with_gpu else (lambda pids: []))
        self.path = path
        self.pause_after = pause_after

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        self.states = {int(p): GpuState[s] for p, s in data.items()}

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(p): s.name for p, s in self.states.items()}))
        tmp.replace(self.path)

    def _step(self, op: str, pid: int, need: GpuState, to: GpuState) -> None:
        self._load()
        super()._step(op, pid, need, to)
        self._save()

    async def _maybe_pause(self, op: str) -> None:
        if self.pause_after == op:
            print(f"after {op}", flush=True)
            await asyncio.sleep(3600)

    async def state(self, pid: int) -> GpuState:
        self._load()
        return await super().state(pid)

    async def lock(self, pids: Sequence[int], wait_s: float) -> None:
        await super().lock(pids, wait_s)
        await self._maybe_pause("lock")

    async def checkpoint(self, pids: Sequence[int]) -> None:
        await super().checkpoint(pids)
        await self._maybe_pause("checkpoint")

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        await super().restore(pids, remap)
        await self._maybe_pause("restore")

    async def unlock(self, pids: Sequence[int]) -> None:
        await super().unlock(pids)
        await self._maybe_pause("unlock")

    def stuck_now(self) -> dict[int, GpuState]:
        """Processes the file says are left locked or checkpointed."""
        self._load()
        return self.stuck()


class PauseAt:
    """The engine's ``Faults`` seam: before ``step``, print ``at <step>`` and wait."""

    def __init__(self, step: str | None) -> None:
        self.step = step

    async def before(self, step: str) -> None:
        if step == self.step:
            print("at", step, flush=True)
            await asyncio.sleep(3600)
