"""The demo trainer on the GPU, as test_gpu_checkpoint.py drives it: its uninterrupted output
(the reference), the same trainer started as a job, and the checks that a restored trainer
ends exactly as the reference did.

The demo job trains a small regression on the GPU with deterministic algorithms and prints
every step's loss and a running checksum of the exact values, so a trainer that went through
any pause, failed checkpoint or restore must print byte-identical lines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sgtest import until
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import CudaHook, GpuState, driver_available, inventory
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo, exit_status, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.timeline import Step

ENV = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "PYTHONUNBUFFERED": "1"}
JOB = [sys.executable, "-m", "spotguard.demo.job", "--gpu", "yes", "--mb", "512", "--steps", "80"]


@pytest.fixture(scope="module")
def gpu_ready() -> None:
    if not driver_available() or not inventory().count:
        pytest.skip("needs an NVIDIA GPU with the driver checkpoint API (driver r570+)")


def steps_text(steps: list[Step]) -> str:
    return ", ".join(
        f"{s.name} {s.seconds or 0:.3f}" + (" [placed]" if s.detail.get("overlap") else "")
        for s in steps
    )


def lines(p: Path) -> list[str]:
    return p.read_text().splitlines() if p.exists() else []


async def reference_and_training(
    criu_bin: str, tmp_path: Path, name: str, **settings_: Any
) -> tuple[list[str], CheckpointSettings, Engine, JobInfo]:
    """The trainer's output run straight through (the reference), then the same trainer
    started as ``name`` (a step every 50 ms) with an engine over the GPU driver (its
    ``[checkpoint]`` settings changed by ``settings_``)."""
    done = await asyncio.to_thread(
        subprocess.run, [*JOB, "--step-seconds", "0"], capture_output=True, text=True, env=ENV,
        check=True,
    )  # fmt: skip
    settings = CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin, **settings_)
    engine = Engine(Criu(criu_bin), CudaHook(), settings=settings)
    job = await start_job(
        [*JOB, "--step-seconds", "0.05"], name, state_dir=settings.state_dir, env=ENV
    )
    return done.stdout.splitlines(), settings, engine, job


async def finishes_as_the_reference(job: JobInfo, out: Path, ref: list[str]) -> None:
    """The restored trainer ``job`` runs to its end, cleanly, its output ``out`` the
    uninterrupted run's line for line (losses bit-identical)."""
    await until(lambda: exit_status(job) is not None, "the restored job to finish", limit=120)
    assert exit_status(job) == 0
    assert lines(out) == ref
    print(f"losses bit-identical to the reference over {len(ref)} lines")


async def trains_on_its_gpu(engine: Engine, job: JobInfo, why: str) -> None:
    """``job`` prints more steps, and every GPU process of it runs on the GPU (not locked,
    not checkpointed: nothing of the driver's side was left behind)."""
    out = job.dir / "stdout"
    n = len(lines(out))
    await until(lambda: len(lines(out)) > n + 3, why, 60)
    gpids = await engine.gpu.gpu_pids(proctree.tree(job.pid))
    states = [await engine.gpu.state(p) for p in gpids]
    assert gpids and states == [GpuState.RUNNING] * len(gpids), states


async def exits_and_restores_as_the_reference(
    engine: Engine, job: JobInfo, settings: CheckpointSettings, img: Path, ref: list[str]
) -> None:
    """After a checkpoint that went wrong: the trainer ``job`` trains on, on its GPU; an exit
    image of it into ``img`` restores, and the restored trainer ends as the reference."""
    await trains_on_its_gpu(engine, job, "training after the checkpoint that went wrong")
    frozen = await engine.freeze(job, DirectoryTarget(img), Mode.EXIT)
    print(f"\nthe exit freeze after it: {steps_text(frozen.timeline.steps)}")
    restored = await engine.restore(DirectorySource(img), state_dir=settings.state_dir)
    try:
        await finishes_as_the_reference(restored.job, job.dir / "stdout", ref)
    finally:
        proctree.signal_all([restored.pid], signal.SIGKILL)
