"""Shared by the GPU container tests on CPU: the public driver double
(:class:`~spotguard.checkpoint.testing.RecordingGpu`) as it looks through a container
runtime's CRIU, injected where :mod:`spotguard.container.gpu` asks for the driver, and one
log of the double's calls and the runtime's commands, in the order they happened."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from sgtest import wait_lines
from spotguard.checkpoint.cuda import GpuState
from spotguard.checkpoint.testing import RecordingGpu
from spotguard.container import (
    ContainerCheckpoint,
    ContainerImage,
    ContainerRef,
    ContainerRestore,
    dispatch,
    park,
)
from spotguard.container.dispatch import Backend
from spotguard.facts import GpuDevice, GpuInventory
from spotguard.image import ImageReader, ImageSettings

H100 = "NVIDIA H100 80GB HBM3"
#: what the double's calls are called in the log (``state`` asks, it changes nothing)
GPU_OPS = ("lock", "checkpoint", "restore", "unlock")

Log = list[tuple[str, int]]


def host(*uuids: str, model: str = H100) -> GpuInventory:
    """A host's GPUs: ``uuids`` in index order, all of ``model``."""
    return GpuInventory(
        devices=tuple(GpuDevice(i, u, model, 80 << 30) for i, u in enumerate(uuids)),
        driver="580.159.04",
    )


def _started(pid: int) -> float | None:
    """When ``pid`` started (its identity); None when it is gone or a zombie."""
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


class CriuGpu(RecordingGpu):
    """The driver double as a container runtime's CRIU meets it: the container's init process
    holds GPU state; one dumped while its GPU state was checkpointed comes back from CRIU's
    images (a new host pid) still checkpointed, as the driver reports a process CRIU restored.
    ``dumped``: such processes already in an image (a restore on another host). Every call is
    appended to ``log`` (shared with the runtime's commands); each restore's pairs to
    ``remaps``."""

    def __init__(
        self,
        inventory: GpuInventory,
        *,
        log: Log,
        dumped: int = 0,
        fail_on: str | None = None,
    ) -> None:
        super().__init__(inventory=inventory, fail_on=fail_on)
        self.calls = log
        self.dumped = dumped
        self.born: dict[int, float | None] = {}
        self.remaps: list[Mapping[str, str] | None] = []

    def _carry(self, pid: int) -> None:
        """Processes checkpointed and gone went into CRIU's images; a process not seen before
        is one of them restored (while any is there to restore)."""
        for p, s in list(self.states.items()):
            if s is GpuState.CHECKPOINTED and _started(p) != self.born.get(p):
                del self.states[p]
                self.dumped += 1
        if pid not in self.born:
            self.born[pid] = _started(pid)
            if self.dumped:
                self.dumped -= 1
                self.states[pid] = GpuState.CHECKPOINTED

    def _step(self, op: str, pid: int, need: GpuState, to: GpuState) -> None:
        self._carry(pid)
        super()._step(op, pid, need, to)

    async def state(self, pid: int) -> GpuState:
        self._carry(pid)
        return await super().state(pid)

    async def restore(self, pids: Sequence[int], remap: Mapping[str, str] | None = None) -> None:
        self.remaps.append(remap)
        await super().restore(pids, remap)


def use(monkeypatch: pytest.MonkeyPatch, driver: CriuGpu) -> CriuGpu:
    """``driver`` is the GPU driver :mod:`spotguard.container.gpu` finds from now on."""
    monkeypatch.setattr("spotguard.container.gpu.gpu_hook", lambda *_: driver)
    return driver


def log_commands(monkeypatch: pytest.MonkeyPatch, runtime: type[Any], name: str, log: Log) -> None:
    """Every ``runtime.run(ARGS...)`` appends ``("NAME ARG1 ARG2", 0)`` to ``log``."""
    real = runtime.run

    async def run(self: Any, *args: str, **kw: Any) -> str:
        log.append((" ".join((name, *args[:2])), 0))
        out: str = await real(self, *args, **kw)
        return out

    monkeypatch.setattr(runtime, "run", run)


def steps(log: Log, *commands: str) -> list[str]:
    """The log's driver steps (``lock PID``...) and the runtime's commands that start with one
    of ``commands`` (named by it; a command tried again right after itself counts once), in
    order; ``log`` is emptied."""
    out: list[str] = []
    for op, pid in log:
        if op in GPU_OPS:
            out.append(f"{op} {pid}")
            continue
        named = [c for c in commands if op == c or op.startswith(c + " ")][:1]
        if named and out[-1:] != named:
            out += named
    log.clear()
    return out


@dataclass
class On:
    """spotguard's container operations, in this process, on one "VM" (its runtime and state
    dir): where the double injected by :func:`use` is the driver."""

    backend: Backend
    state_dir: Path
    settings: ImageSettings = field(default_factory=lambda: ImageSettings.model_validate({}))

    async def checkpoint(
        self, ref: ContainerRef, to: str, *, leave_running: bool = False
    ) -> ContainerCheckpoint:
        return await dispatch.checkpoint(
            ref, to, backend=self.backend, image_settings=self.settings,
            state_dir=self.state_dir, leave_running=leave_running,
        )  # fmt: skip

    async def restore(self, url: str) -> ContainerRestore:
        return await dispatch.restore(
            url, backend=self.backend, image_settings=self.settings, state_dir=self.state_dir
        )

    async def park(self, ref: ContainerRef, to: str) -> None:
        await park.park(
            ref, to, podman=self.backend, image_settings=self.settings, state_dir=self.state_dir
        )

    async def unpark(self, ref: ContainerRef) -> None:
        await park.unpark(
            ref, podman=self.backend, image_settings=self.settings, state_dir=self.state_dir
        )


async def record_of(url: str) -> ContainerImage:
    """The container record an image's manifest carries."""
    async with ImageReader(url, settings=ImageSettings.model_validate({})) as r:
        return ContainerImage.from_meta(r.manifest.meta, url)


async def park_and_unpark(
    on: On, ref: ContainerRef, there: CriuGpu, pid: int, log: Log, seen: Sequence[str],
    pause: str, resume: str,
) -> None:  # fmt: skip
    """Park ``ref`` in memory and unpark it: the GPU freed (checkpointed and locked) before
    the runtime's ``pause``, put back after its ``resume`` — in that order, nothing left
    locked. ``seen``: the runtime's commands the log is read for."""
    await on.park(ref, "memory")
    assert there.stuck() != {}  # parked: checkpointed and locked
    await on.unpark(ref)
    assert steps(log, *seen) == [
        f"lock {pid}", f"checkpoint {pid}", pause, resume, f"restore {pid}", f"unlock {pid}",
    ]  # fmt: skip
    assert there.stuck() == {}


def counted_on(out: Path, stopped: int) -> None:
    """The job's file runs on past ``stopped`` lines, every number once, in order: the job
    continued from where the exit checkpoint stopped it."""
    wait_lines(out, stopped + 3)
    lines = out.read_text().splitlines()
    assert lines == [str(i) for i in range(len(lines))]
