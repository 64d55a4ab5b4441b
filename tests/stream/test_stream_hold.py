"""A leave-running streamed checkpoint holds the image in host memory and lets the job go on.

The job is frozen only while its pages are copied out of it; the store gets them after. With
a store that stalls (``GatedStore``: every chunk after the second waits), the job must be
running again before the store has the image, and the image, once committed, must restore to
exactly the job at the freeze. ``resume_buffer_mb = 0`` keeps the old behaviour: the job waits
for the store. Real CRIU, real processes, a real file store behind the gate.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from stream_helpers import MIB, kill_tree, start_stream_job, wait_done, wait_lines

from sgtest import GatedStore
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.hold import NO_HOLD, Hold
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.store import open_store
from spotguard.stream import StreamSource, StreamTarget

pytestmark = [
    pytest.mark.criu,
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

SMALL = {"chunk_size": 1 << 20, "max_inflight": 2}


def _lines(job: JobInfo) -> int:
    path = job.dir / "stdout"
    return path.read_text().count("\n") if path.exists() else 0


async def test_a_leave_running_checkpoint_lets_the_job_go_on_while_the_store_is_stalled(
    criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path
) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    gated = GatedStore(open_store(store_url))
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())  # resume_buffer_mb: auto
    job = await start_stream_job(job_script, tmp_path / "state", "hold-auto")
    target = StreamTarget(gated, work_root=tmp_path / "work", writer_options=SMALL,  # type: ignore[arg-type]
                          settings=ImageSettings(pipe_mb=1))  # fmt: skip
    freeze = asyncio.create_task(engine.freeze(job, target, Mode.RESUME))
    try:
        await asyncio.wait_for(gated.blocked.wait(), 30)  # the store holds the image back
        at_stall = _lines(job)
        # the job runs on although only two chunks of its image are stored
        await wait_lines(job.dir / "stdout", at_stall + 5, limit=20)
        assert not freeze.done(), "the image cannot be durable: the store took two chunks"
        assert target.manifest is None
    finally:
        gated.gate.set()
    result = await asyncio.wait_for(freeze, 60)
    assert target.manifest is not None and target.url is not None
    plan = result.timeline.to_list()
    (staging,) = [e for e in plan if e["name"] == "staging"]
    assert staging["detail"]["hold_bytes"] >= MIB << 20, staging
    kill_tree(job.pid)
    await asyncio.sleep(0.3)

    # The image is the job as it was frozen, not as it went on: restored, it prints exactly
    # what an uninterrupted run prints.
    source = StreamSource(target.url, settings=ImageSettings(), work_root=tmp_path / "work2")
    restored = await engine.restore(source, state_dir=tmp_path / "state")
    try:
        assert await wait_done(job.dir / "stdout") == reference_output
    finally:
        kill_tree(restored.pid)
    await gated.inner.aclose()


async def test_with_no_resume_buffer_the_job_waits_for_the_store(
    criu_bin: str, job_script: Path, tmp_path: Path
) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    gated = GatedStore(open_store(store_url))
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings(resume_buffer_mb=0))
    job = await start_stream_job(job_script, tmp_path / "state", "hold-none")
    target = StreamTarget(gated, work_root=tmp_path / "work", writer_options=SMALL,  # type: ignore[arg-type]
                          settings=ImageSettings(pipe_mb=1), buffer_bytes=4 << 20)  # fmt: skip
    freeze = asyncio.create_task(engine.freeze(job, target, Mode.RESUME))
    try:
        await asyncio.wait_for(gated.blocked.wait(), 30)
        at_stall = _lines(job)
        await asyncio.sleep(1.0)  # ~30 lines' time: the job would have printed them
        assert _lines(job) == at_stall, "the job ran before its pages were out of CRIU"
        assert not freeze.done()
    finally:
        gated.gate.set()
    result = await asyncio.wait_for(freeze, 60)
    (staging,) = [e for e in result.timeline.to_list() if e["name"] == "staging"]
    assert staging["detail"]["hold_bytes"] == 0
    assert target.manifest is not None
    await wait_lines(job.dir / "stdout", at_stall + 5, limit=20)  # and then it goes on
    kill_tree(job.pid)
    await gated.inner.aclose()


@pytest.mark.parametrize("setting_mb", [-1, 64])
async def test_an_exit_checkpoint_holds_nothing(
    setting_mb: int, criu_bin: str, job_script: Path, tmp_path: Path
) -> None:
    """The job ends at the dump: holding its image in memory would only delay durability."""
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings(resume_buffer_mb=setting_mb))
    job = await start_stream_job(job_script, tmp_path / "state", "hold-exit")
    target = StreamTarget(f"file://{tmp_path / 'store'}", work_root=tmp_path / "work",
                          writer_options=SMALL, settings=ImageSettings())  # fmt: skip
    try:
        result = await engine.freeze(job, target, Mode.EXIT)
    finally:
        kill_tree(job.pid)
    (staging,) = [e for e in result.timeline.to_list() if e["name"] == "staging"]
    assert staging["detail"]["hold_bytes"] == 0


@pytest.mark.parametrize(
    ("held", "prefaulted"),
    [(True, False), (True, True), (False, False)],
    ids=["held", "held-in-pieces-faulted-in-first", "not-held"],
)
async def test_gpu_memory_copied_beside_criu_is_held_while_the_store_is_stalled(
    held: bool, prefaulted: bool, tmp_path: Path
) -> None:
    """The GPU memory the driver staged goes into the writer's own buffers (``put_pages``),
    or, with its size known and the hold faulted in first, into the capture's pieces made
    before the freeze: with a hold it is all copied while the store takes nothing, without
    one the copy waits."""
    gated = GatedStore(open_store(f"file://{tmp_path / 'store'}"), allow=0)
    target = StreamTarget(gated, work_root=tmp_path / "work", writer_options=SMALL,  # type: ignore[arg-type]
                          settings=ImageSettings())  # fmt: skip
    chunks = 12
    pages = chunks << 20
    hold = Hold(0, pages, prefault_pages=pages if prefaulted else 0) if held else NO_HOLD
    plan = await target.start("hold-pages", chunks << 20, hold)
    assert plan.hold_bytes == hold.total
    made = [s.detail["bytes"] for s in target.timeline_steps if s.name == "hold_prefault"]
    assert made == ([pages] if prefaulted else [])
    copied: list[int] = []

    def fill(offset: int, view: memoryview) -> None:
        view[:] = bytes([1 + offset // (1 << 20)]) * len(view)  # not zero: each is stored
        copied.append(offset)

    put = asyncio.create_task(target.put_pages("gpupages-7-1a-0", chunks << 20, fill))
    try:
        await asyncio.wait_for(gated.blocked.wait(), 10)
        await asyncio.sleep(0.5)
        if held:
            await asyncio.wait_for(put, 10)  # every chunk copied, none stored yet
            assert len(copied) == chunks
            # into the capture's pieces made before (prefaulted), else the writer's buffers (a
            # piece goes back once its chunk is packed: not one per chunk at once)
            assert target._capture is not None and target._capture.pieces is not None
            assert (target._capture.pieces.peak > 0) is prefaulted
        else:
            assert not put.done() and len(copied) < chunks
    finally:
        gated.gate.set()
        await asyncio.wait_for(put, 30)
        await target.abort()
        await gated.inner.aclose()
    assert len(copied) == chunks
