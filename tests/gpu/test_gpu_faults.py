"""Faults on a real GPU job (device machine: scripts/gpu-tests): what a user must be able to
count on when a checkpoint or a restore goes wrong with the GPU in the middle of it.

- The store goes away while an exit checkpoint streams, after the driver has checkpointed the
  GPU and while CRIU holds the job: the job must train on, on its GPU, and lose nothing.
- A chunk of the GPU memory is altered in the store: the restore is refused, typed and naming
  the chunk, leaving no process and no GPU memory held; the same image restores exactly once
  the chunk is put back (the refusal harmed nothing).

The CPU side of both is tested without a GPU (tests/stream/test_stream_engine.py,
tests/checkpoint/test_gpu_pages.py with the driver's staging stood in for).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
from pathlib import Path

import psutil
import pytest
from trainer_rig import (
    finishes_as_the_reference,
    gpu_ready,
    lines,
    reference_and_training,
    steps_text,
    trains_on_its_gpu,
)

from sgtest import FailingStore, flip_a_byte, until
from spotguard import nvml
from spotguard.checkpoint import proctree
from spotguard.checkpoint.engine import Mode
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CheckpointError, ImageCorrupt, StoreUnavailable
from spotguard.image import ImageSettings
from spotguard.image.catalog import latest_image
from spotguard.image.reader import ImageReader
from spotguard.names import chunk_key
from spotguard.store import open_store
from spotguard.stream import StreamSource, StreamTarget

pytestmark = [pytest.mark.gpu, pytest.mark.criu]
__all__ = ["gpu_ready"]  # a fixture, used by name


async def test_an_exit_checkpoint_whose_store_goes_away_leaves_the_job_training_on_its_gpu(
    gpu_ready: None, criu_bin: str, tmp_path: Path
) -> None:
    """The store refuses every chunk after the second while an exit checkpoint of the trainer
    streams (the GPU memory the driver staged is among the chunks, so the job is frozen and
    its GPU checkpointed when it fails). The checkpoint fails, typed; no image is left; the
    job trains on with its GPU state running; an exit image taken after restores to losses
    bit-identical to an uninterrupted run."""
    ref, settings, engine, job = await reference_and_training(criu_bin, tmp_path, "gpu-store-gone")
    out = job.dir / "stdout"
    store_url = f"file://{tmp_path / 'store'}"
    failing = FailingStore(open_store(store_url), allow=2)
    restored = None
    try:
        await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
        target = StreamTarget(failing, work_root=tmp_path / "work", settings=ImageSettings())  # type: ignore[arg-type]
        with pytest.raises((CheckpointError, StoreUnavailable)) as failed:
            await asyncio.wait_for(engine.freeze(job, target, Mode.EXIT), 180)
        print(f"\nthe exit checkpoint failed: {type(failed.value).__name__}: {failed.value}")
        assert target.manifest is None
        assert await latest_image(store_url, job.name, settings=ImageSettings()) is None
        await trains_on_its_gpu(engine, job, "training after the failed checkpoint")
        img = tmp_path / "img"
        frozen = await engine.freeze(job, DirectoryTarget(img), Mode.EXIT)
        print(f"the exit freeze after it: {steps_text(frozen.timeline.steps)}")
        await until(lambda: not proctree.alive(job.pid), "the job to stop", limit=120)
        restored = await engine.restore(DirectorySource(img), state_dir=settings.state_dir)
        await finishes_as_the_reference(restored.job, out, ref)
    finally:
        for pid in {job.pid, *([restored.pid] if restored else [])}:
            proctree.signal_all([pid], signal.SIGKILL)
        await failing.inner.aclose()


def _trainers(*, on_gpu: bool) -> list[int]:
    """Host PIDs of live demo trainers; with ``on_gpu``, of those holding GPU memory (NVML)."""
    pids = [p.pid for p in nvml.processes() or []] if on_gpu else psutil.pids()
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if proctree.alive(pid) and "spotguard.demo.job" in " ".join(
                psutil.Process(pid).cmdline()
            ):
                found.append(pid)
    return found


async def test_an_altered_chunk_of_gpu_memory_is_refused_and_leaves_nothing_on_the_gpu(
    gpu_ready: None, criu_bin: str, tmp_path: Path
) -> None:
    """One stored chunk of the GPU memory in the trainer's image altered (a bit flipped): the
    restore fails with ``ImageCorrupt`` naming it, no process of the job is left, and no
    trainer holds GPU memory. The chunk put back, the same image restores and the trainer
    ends bit-identical to an uninterrupted run."""
    ref, settings, engine, job = await reference_and_training(criu_bin, tmp_path, "gpu-altered")
    out = job.dir / "stdout"
    store = tmp_path / "store"
    restored = None
    try:
        await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
        target = StreamTarget(
            open_store(store.as_uri()), work_root=tmp_path / "work", settings=ImageSettings()
        )
        frozen = await engine.freeze(job, target, Mode.EXIT)
        await until(lambda: not proctree.alive(job.pid), "the job to stop", limit=120)
        assert target.url is not None and frozen.meta.gpu_pages, "no GPU memory in the image"
        names = {p.name for g in frozen.meta.gpu_pages for p in g.parts}
        async with ImageReader(target.url, settings=ImageSettings()) as reader:
            refs = [c for f in reader.manifest.files if f.name in names for c in f.chunks]
        victim = max(refs, key=lambda c: c.stored_size)  # data, not a zero chunk
        path = store / chunk_key(job.name, victim.digest)
        good = path.read_bytes()
        path.chmod(0o600)
        flip_a_byte(path)
        shutil.rmtree(job.dir)  # as on a new machine
        with pytest.raises(ImageCorrupt, match=victim.digest):
            await engine.restore(
                StreamSource(target.url, work_root=tmp_path / "w1", settings=ImageSettings()),
                state_dir=settings.state_dir,
            )
        await until(lambda: not _trainers(on_gpu=True), "no trainer on the GPU", limit=30)
        assert not _trainers(on_gpu=False), "a restored process of the job was left"
        path.write_bytes(good)
        restored = await engine.restore(
            StreamSource(target.url, work_root=tmp_path / "w2", settings=ImageSettings()),
            state_dir=settings.state_dir,
        )
        print(f"\nrestored once the chunk was put back: {steps_text(restored.timeline.steps)}")
        await finishes_as_the_reference(restored.job, out, ref)
    finally:
        for pid in {job.pid, *([restored.pid] if restored else [])}:
            proctree.signal_all([pid], signal.SIGKILL)
