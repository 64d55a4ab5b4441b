"""GPU checkpoint/restore of a real PyTorch training job (device machine: scripts/gpu-tests).

The demo job trains a small regression on the GPU with deterministic algorithms and prints
every step's loss and a running checksum of the exact values. A job that is paused
(leave-running), then checkpointed, killed and restored from its image (job directory
deleted, as on a new machine) must print byte-identical lines to an uninterrupted run.

Faults with the GPU in the middle: the store going away while an exit checkpoint streams
(the job trains on, on its GPU, and loses nothing), and a chunk of the GPU memory altered in
the store (the restore refused, typed and naming the chunk, leaving no process and no GPU
memory held; the image restores exactly once the chunk is back). Their CPU side is tested
without a GPU (tests/stream/test_stream_engine.py, tests/checkpoint/test_gpu_pages.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from trainer_rig import (
    exits_and_restores_as_the_reference,
    finishes_as_the_reference,
    gpu_ready,
    lines,
    reference_and_training,
    steps_text,
)

from sgtest import FailingStore, GatedStore, flip_a_byte, until
from spotguard import nvml
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import has_external_pages
from spotguard.checkpoint.cuda import CudaHook, inventory
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.results import FreezeResult
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


async def test_training_job_losses_bit_identical_after_pause_checkpoint_kill_restore(
    gpu_ready: None, criu_bin: str, tmp_path: Path
) -> None:
    # the job in its own PID and mount namespaces: CUDA initialises there (private /proc)
    ref, _, engine, job = await reference_and_training(criu_bin, tmp_path, "gpu-train")
    out = job.dir / "stdout"
    err = job.dir / "stderr"
    try:
        await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
        paused = await engine.freeze(job, DirectoryTarget(tmp_path / "img-resume"), Mode.RESUME)
        assert paused.gpu_pids, "the job's GPU process was not found"
        n = len(lines(out))
        await until(
            lambda: len(lines(out)) > n + 5, "training to continue after the pause", limit=120
        )
        print(
            f"\nleave-running pause: {paused.pause_seconds:.3f} s "
            f"({', '.join(f'{s.name} {s.seconds:.3f}' for s in paused.timeline.steps)})"
        )

        frozen = await engine.freeze(job, DirectoryTarget(tmp_path / "img-exit"), Mode.EXIT)
        await until(lambda: not proctree.alive(job.pid), "the job to stop", limit=120)
        assert len(lines(out)) < len(ref), "the job finished before the checkpoint"
        shutil.rmtree(job.dir)
        restored = await engine.restore(DirectorySource(frozen.images_dir))
        assert restored.gpu_pids
        # the driver's staged GPU memory went beside CRIU, in files of its own, and came back
        # (with spotguard's CRIU; Debian's moves it through its pipes as before)
        if has_external_pages(criu_bin):
            assert frozen.meta.gpu_pages, "the driver's staging was not found"
            assert any(s.name == "gpu_pages" for s in restored.timeline.steps)
            staged = sum(g.end - g.start for g in frozen.meta.gpu_pages)
            print(f"GPU memory carried beside CRIU: {staged >> 20} MiB")
        print(f"exit-mode freeze: {steps_text(frozen.timeline.steps)}")
        print(f"restore: {steps_text(restored.timeline.steps)}")
        await finishes_as_the_reference(restored.job, out, ref)
    except BaseException:
        print("job stderr:", err.read_text()[-3000:] if err.exists() else "(none)")
        raise
    finally:
        for pid in {job.pid, *([restored.pid] if "restored" in locals() else [])}:
            proctree.signal_all([pid], signal.SIGKILL)


@dataclass
class _Pausing:
    """A leave-running checkpoint of a training job under way into a store that holds the
    image back (``gated``): its ``target``, its ``task``, and how many lines the job had
    printed when the store first stalled (``lines_then``)."""

    gated: GatedStore
    target: StreamTarget
    task: asyncio.Task[FreezeResult]
    lines_then: int


@contextlib.asynccontextmanager
async def _paused_into_a_stalled_store(
    engine: Engine, job: JobInfo, store: Path, work: Path
) -> AsyncIterator[_Pausing]:
    """Once the job has trained a few steps, pause it into a file store at ``store`` that
    stalls at its first chunk; yields once it has stalled. The store is let go and closed
    on the way out."""
    out = job.dir / "stdout"
    gated = GatedStore(open_store(f"file://{store}"))
    try:
        await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
        target = StreamTarget(gated, work_root=work, settings=ImageSettings())  # type: ignore[arg-type]
        task = asyncio.create_task(engine.freeze(job, target, Mode.RESUME))
        await asyncio.wait_for(gated.blocked.wait(), 120)
        yield _Pausing(gated, target, task, len(lines(out)))
    finally:
        gated.gate.set()
        await gated.inner.aclose()


async def test_a_streamed_pause_lets_training_go_on_while_the_store_is_stalled(
    gpu_ready: None, criu_bin: str, tmp_path: Path
) -> None:
    """A leave-running checkpoint to a store copies the job's image (the GPU memory the
    driver staged, CRIU's files) into host memory and lets the job train on; the store takes
    it after. The store here holds every chunk after the second until the job has trained
    on; the image then restores to losses bit-identical to an uninterrupted run."""
    ref, settings, engine, job = await reference_and_training(criu_bin, tmp_path, "gpu-train-hold")
    out = job.dir / "stdout"
    try:
        async with _paused_into_a_stalled_store(
            engine, job, tmp_path / "store", tmp_path / "work"
        ) as p:
            target, n = p.target, p.lines_then
            try:
                await until(lambda: len(lines(out)) > n + 5, "training while the store stalls", 60)
            except BaseException:
                w, c = target._writer, target._capture
                print("plan", target.plan, "pages hold left", target._pages_hold)
                if w is not None:
                    print("writer in flight", w.max_inflight, "input", w.input_limit, w.stats)
                if c is not None:
                    print("captured", c.stats.files)
                raise
            assert not p.task.done(), "durable with two chunks stored"
            p.gated.gate.set()
            paused = await asyncio.wait_for(p.task, 300)
        (staging,) = [s for s in paused.timeline.steps if s.name == "staging"]
        print(
            f"\nstreamed pause: {paused.pause_seconds:.3f} s, "
            f"{staging.detail['hold_bytes'] >> 20} MiB held ({steps_text(paused.timeline.steps)})"
        )
        assert target.url is not None
        proctree.signal_all([job.pid], signal.SIGKILL)
        await until(lambda: not proctree.alive(job.pid), "the job to stop", limit=60)
        shutil.rmtree(job.dir)
        source = StreamSource(target.url, settings=ImageSettings(), work_root=tmp_path / "w2")
        restored = await engine.restore(source, state_dir=settings.state_dir)
        await finishes_as_the_reference(restored.job, out, ref)
    finally:
        for pid in {job.pid, *([restored.pid] if "restored" in locals() else [])}:
            proctree.signal_all([pid], signal.SIGKILL)


@pytest.mark.parametrize("frozen", [False, True], ids=["while-it-uploads", "while-frozen"])
async def test_a_pause_given_up_leaves_the_job_training_on_its_gpu(
    gpu_ready: None, criu_bin: str, tmp_path: Path, frozen: bool
) -> None:
    """What an interruption notice does to a leave-running checkpoint under way
    (:mod:`spotguard.agent.giveway`), or an agent stopping: the pause is cancelled while its
    store stalls — held in memory (the default), after the job trains again; or holding
    nothing (``resume_buffer_mb = 0``), while the job is still frozen, its GPU checkpointed,
    waiting for the store. Either way the job trains on with its GPU state running, the
    stalled image gets no manifest, and an exit image taken then restores to losses
    bit-identical to an uninterrupted run."""
    ref, settings, engine, job = await reference_and_training(
        criu_bin, tmp_path, "gpu-gave-way", **({"resume_buffer_mb": 0} if frozen else {})
    )
    out = job.dir / "stdout"
    try:
        async with _paused_into_a_stalled_store(
            engine, job, tmp_path / "stalled", tmp_path / "work"
        ) as p:
            n = p.lines_then
            if frozen:
                await asyncio.sleep(1.0)
                assert len(lines(out)) == n, "the job trained while its pause waited for the store"
            else:
                await until(lambda: len(lines(out)) > n + 3, "training while the store stalls", 60)
            p.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(p.task, 120)
            assert p.target.manifest is None
            await exits_and_restores_as_the_reference(engine, job, settings, tmp_path / "img", ref)
    finally:
        proctree.signal_all([job.pid], signal.SIGKILL)


async def _exit_image_in_a_store(
    engine: Engine, job: JobInfo, tmp_path: Path
) -> tuple[StreamTarget, FreezeResult]:
    """The trainer, some steps in, frozen (exit) into the file store ``tmp_path/store``."""
    out = job.dir / "stdout"
    await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
    store = open_store((tmp_path / "store").as_uri())
    target = StreamTarget(store, work_root=tmp_path / "work", settings=ImageSettings())
    frozen = await engine.freeze(job, target, Mode.EXIT)
    await until(lambda: not proctree.alive(job.pid), "the job to stop", limit=120)
    return target, frozen


class _StalledSource(StreamSource):
    """A store that stops answering once the staged GPU memory is asked for."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gate, self.asked = asyncio.Event(), asyncio.Event()

    async def get_pages(self, *args: Any, **kw: Any) -> None:
        self.asked.set()
        await self.gate.wait()
        await super().get_pages(*args, **kw)


async def test_a_restore_given_up_while_the_store_stalls_leaves_nothing_on_the_gpu(
    gpu_ready: None, criu_bin: str, tmp_path: Path
) -> None:
    """The trainer's restore, its staged GPU memory placed under the driver's restore, given
    up while the store stalls (the agent stopping, a deadline): the driver's restore waits on
    pages that will never come until its process dies, so the restore kills it and ends —
    within a minute, with no trainer holding GPU memory — and the image restores once the
    store answers, to losses bit-identical to an uninterrupted run."""
    ref, settings, engine, job = await reference_and_training(
        criu_bin, tmp_path, "gpu-restore-stalled", restore_overlap_min_mib=0
    )
    out = job.dir / "stdout"
    restored = None
    try:
        target, _ = await _exit_image_in_a_store(engine, job, tmp_path)
        assert target.url is not None
        shutil.rmtree(job.dir)
        stalled = _StalledSource(target.url, work_root=tmp_path / "w1", settings=ImageSettings())
        restoring = asyncio.create_task(engine.restore(stalled, state_dir=settings.state_dir))
        await asyncio.wait_for(stalled.asked.wait(), 120)
        await asyncio.sleep(1.0)
        restoring.cancel()
        done, _ = await asyncio.wait({restoring}, timeout=60)
        stalled.gate.set()
        assert done, "the restore given up still waits for the store"
        await until(lambda: not _trainers(on_gpu=True), "no trainer on the GPU", limit=30)
        assert not _trainers(on_gpu=False), "a restored process of the job was left"
        again = StreamSource(target.url, work_root=tmp_path / "w2", settings=ImageSettings())
        restored = await engine.restore(again, state_dir=settings.state_dir)
        print(f"\nrestored once the store answered: {steps_text(restored.timeline.steps)}")
        await finishes_as_the_reference(restored.job, out, ref)
    finally:
        for pid in {job.pid, *([restored.pid] if restored else [])}:
            proctree.signal_all([pid], signal.SIGKILL)


async def test_gpu_processes_are_found_by_the_driver_and_the_remap_path_runs(
    gpu_ready: None, tmp_path: Path
) -> None:
    """A CUDA process and a child it forked (no CUDA context, inherited /dev/nvidia* fds):
    only the first is a GPU process; its GPU state is restored through an explicit mapping
    of each GPU onto itself (the UUID remap path of cuda-core), and it still computes."""
    from spotguard.checkpoint.preflight import gpu_mapping

    code = (
        "import os, sys, time, torch\n"
        "x = torch.arange(1 << 20, device='cuda', dtype=torch.float64)\n"
        "kid = os.fork()\n"
        "if kid == 0:\n    time.sleep(120); os._exit(0)\n"
        "print(kid, flush=True)\n"
        "for line in sys.stdin:\n    print(float((x * 2).sum()), flush=True)\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        kid = int(await proc.stdout.readline())
        assert proctree.uses_device(kid, "/dev/nvidia")  # the fd-based guess would take it
        hook = CudaHook()
        assert await hook.gpu_pids([proc.pid, kid]) == [proc.pid]
        inv = inventory()
        mapping = gpu_mapping(inv, inv)
        assert mapping == {u: u for u in inv.uuids}
        await hook.lock([proc.pid], 10)
        await hook.checkpoint([proc.pid])
        await hook.restore([proc.pid], mapping)
        await hook.unlock([proc.pid])
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        got = await proc.stdout.readline()
        assert float(got) == float(sum(range(1 << 20)) * 2)
        print(f"\nremap path: {mapping} restored and computing")
    finally:
        proctree.signal_all([kid] if "kid" in locals() else [], signal.SIGKILL)
        proc.kill()
        await proc.wait()


def test_inventory_names_the_gpus(gpu_ready: None) -> None:
    inv = inventory()
    assert inv.count >= 1 and inv.model and inv.driver_major and inv.driver_major >= 570
    assert all(d.uuid.startswith("GPU-") and d.memory_total > 0 for d in inv.devices)


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
    try:
        await until(lambda: len(lines(out)) > 10, "first training steps", limit=120)
        target = StreamTarget(failing, work_root=tmp_path / "work", settings=ImageSettings())  # type: ignore[arg-type]
        with pytest.raises((CheckpointError, StoreUnavailable)) as failed:
            await asyncio.wait_for(engine.freeze(job, target, Mode.EXIT), 180)
        print(f"\nthe exit checkpoint failed: {type(failed.value).__name__}: {failed.value}")
        assert target.manifest is None
        assert await latest_image(store_url, job.name, settings=ImageSettings()) is None
        await exits_and_restores_as_the_reference(engine, job, settings, tmp_path / "img", ref)
    finally:
        proctree.signal_all([job.pid], signal.SIGKILL)
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
        target, frozen = await _exit_image_in_a_store(engine, job, tmp_path)
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
