"""Streamed freeze and restore of real CPU jobs through the engine, with real CRIU.

Images go to a file:// store and to S3 (a real moto server); the restored job's output must
equal an uninterrupted run's. Failures: the streamer killed mid-dump, CRIU killed mid-stream —
the job keeps running and no image becomes visible.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from stream_helpers import MIB, kill_tree, start_stream_job, wait_done, wait_lines

from sgtest import FailingStore, GatedStore
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import CheckpointError, ImageNotFound, StoreUnavailable
from spotguard.image import ImageSettings
from spotguard.image.catalog import latest_image
from spotguard.image.reader import ImageReader
from spotguard.store import open_store
from spotguard.stream import StreamSource, StreamTarget, sparse

pytestmark = [
    pytest.mark.criu,
    # the store's retry policy passes tenacity's renamed 'initial' argument (store area)
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
]

S = ImageSettings()
SMALL = {"chunk_size": 1 << 20, "max_inflight": 2}


@pytest.fixture
def s3_store(aws_env: str) -> str:
    import boto3

    boto3.client("s3").create_bucket(Bucket="stream-images")
    return "s3://stream-images/images"


@pytest.mark.parametrize("backend", ["file", "s3"])
async def test_streamed_freeze_and_restore_match_an_uninterrupted_run(
    backend: str,
    criu_bin: str,
    job_script: Path,
    reference_output: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    store = (
        f"file://{tmp_path / 'store'}" if backend == "file" else request.getfixturevalue("s3_store")
    )
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    job = await start_stream_job(job_script, tmp_path / "state", f"stream-{backend}")
    target = StreamTarget(store, work_root=tmp_path / "work", writer_options=SMALL, settings=S)
    result = await engine.freeze(job, target, Mode.EXIT)
    assert target.manifest is not None and target.url is not None  # committed
    assert target.url.endswith(target.manifest.image_id)
    assert not psutil.pid_exists(job.pid) or psutil.Process(job.pid).status() == "zombie"
    names = [s.name for s in target.timeline_steps]
    assert {"stream_capture", "image_commit", "stream_durable"} <= set(names)
    assert result.timeline.seconds("criu_dump") is not None
    url = await latest_image(store, job.name, settings=ImageSettings())
    assert url is not None and url.endswith(target.manifest.image_id)
    stats = target.capture_stats
    assert stats is not None and stats.bytes >= MIB << 20  # the job's memory went through
    assert stats.owned > 0  # page data was compressed in the pieces it was read into

    source = StreamSource(url, settings=ImageSettings(), work_root=tmp_path / "work")
    restored = await engine.restore(source, state_dir=tmp_path / "state")
    try:
        assert source.serve_stats is not None
        # every byte CRIU wrote was fed back, but the all-zero runs of the job's private
        # memory (spotguard.stream.sparse): the pages images less those, the rest exactly
        served, wrote = source.serve_stats.files, stats.files
        assert _pages(served) + source.sparse_bytes == _pages(wrote)
        assert {n: b for n, b in served.items() if not _paging(n)} == {
            n: b for n, b in wrote.items() if not _paging(n)
        }
        # page data went into CRIU's pipes by reference (vmsplice), not copied
        assert source.serve_stats.spliced > 0
        out = await wait_done(job.dir / "stdout")
        assert out == reference_output
    finally:
        kill_tree(restored.pid)


def _paging(name: str) -> bool:
    return bool(sparse.PAGES.fullmatch(name) or sparse.PAGEMAP.fullmatch(name))


def _pages(files: dict[str, int]) -> int:
    return sum(n for name, n in files.items() if sparse.PAGES.fullmatch(name))


def _criu_children() -> list[psutil.Process]:
    """CRIU processes under this test (a child that exits or is a zombie meanwhile is not)."""

    def is_criu(p: psutil.Process) -> bool:
        try:
            return p.name() == "criu" or "criu" in p.exe()
        except psutil.Error:
            return False

    return [p for p in psutil.Process().children(recursive=True) if is_criu(p)]


async def _in_its_hook(criu: psutil.Process, limit: float = 30.0) -> None:
    """Wait until ``criu`` runs its action script (the post-dump hook, spotguard's
    ``action.sh``): the dump is over and every task cured."""

    def hooked() -> bool:
        with contextlib.suppress(psutil.Error):
            return any(any(a.endswith("action.sh") for a in c.cmdline()) for c in criu.children())
        return False

    end = time.monotonic() + limit
    while not await asyncio.to_thread(hooked):
        assert time.monotonic() < end, "CRIU never ran its post-dump hook"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("strike", "pipe_mb"),
    [("streamer", 1), ("criu", 1), ("streamer", 64)],
    # 1 MiB pipes: CRIU is blocked mid-dump; 64 MiB: CRIU may have written everything and
    # the capture is stopped while the engine waits for the last pieces (a typed error too).
    # CRIU itself is killed while it waits in its post-dump hook for the image to be durable
    # (the tree frozen, every task cured): killed while it sets its parasite up or takes it
    # out of a task, that task is left at a breakpoint no one traces and dies of SIGTRAP —
    # what no one but CRIU can undo, which is why nothing of spotguard's kills a dump's CRIU
    # (checkpoint/criu.py) and the agent's unit leaves it alive (KillMode=process)
    ids=["streamer-mid-dump", "criu-in-post-dump-hook", "streamer-after-dump"],
)
async def test_killed_mid_stream_leaves_job_running_and_no_image(
    strike: str,
    pipe_mb: int,
    criu_bin: str,
    job_script: Path,
    reference_output: str,
    tmp_path: Path,
) -> None:
    store_url = f"file://{tmp_path / 'store'}"
    gated = GatedStore(open_store(store_url))
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    job = await start_stream_job(job_script, tmp_path / "state", f"strike-{strike}")
    s = ImageSettings(pipe_mb=pipe_mb)
    target = StreamTarget(gated, work_root=tmp_path / "work", writer_options=SMALL, settings=s)  # type: ignore[arg-type]
    freeze = asyncio.create_task(engine.freeze(job, target, Mode.EXIT))
    await asyncio.wait_for(gated.blocked.wait(), 30)  # the store holds the image back
    image_url = target.url
    assert image_url is not None
    if strike == "streamer":
        assert target._capture is not None
        await target._capture.abort()  # what a dead streamer looks like to CRIU: EPIPE
    else:
        (criu,) = _criu_children()
        await _in_its_hook(criu)
        os.kill(criu.pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
    gated.gate.set()
    with pytest.raises(CheckpointError):
        await asyncio.wait_for(freeze, 60)

    # The job runs on, untouched: its output still matches an uninterrupted run.
    assert psutil.pid_exists(job.pid)
    try:
        assert await wait_done(job.dir / "stdout") == reference_output
    finally:
        kill_tree(job.pid)
    # Chunks may have reached the store, but no image exists: no manifest, nothing to read.
    chunks = await gated.inner.list(f"{job.name}/chunks/")
    assert chunks, "the dump was stopped before any chunk was stored"
    assert await latest_image(store_url, job.name, settings=ImageSettings()) is None
    with pytest.raises(ImageNotFound):
        async with ImageReader(image_url, settings=ImageSettings()):
            pass
    await gated.inner.aclose()


async def test_exit_mode_upload_failing_mid_stream_never_kills_the_job(
    criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path
) -> None:
    """In exit mode the engine commits the streamed image while CRIU holds the tree frozen and
    lets CRIU kill it only after that: a store failing mid-stream leaves the job running."""
    store_url = f"file://{tmp_path / 'store'}"
    failing = FailingStore(open_store(store_url), allow=2)
    job = await start_stream_job(job_script, tmp_path / "state", "exit-upload-fails")
    target = StreamTarget(failing, work_root=tmp_path / "work", writer_options=SMALL, settings=S)  # type: ignore[arg-type]
    with pytest.raises((CheckpointError, StoreUnavailable)) as failed:
        await asyncio.wait_for(
            Engine(Criu(criu_bin), settings=CheckpointSettings()).freeze(job, target, Mode.EXIT), 60
        )
    # Before CRIU finished (EPIPE: CRIU fails and resumes the tree) or while it waited in
    # post-dump (the commit failed: CRIU is told to fail): either way the store is the cause.
    cause = failed.value if isinstance(failed.value, StoreUnavailable) else target.capture_error
    assert isinstance(cause, StoreUnavailable), failed.value
    assert target.manifest is None
    assert psutil.pid_exists(job.pid) and psutil.Process(job.pid).status() != "zombie"
    try:
        assert await wait_done(job.dir / "stdout") == reference_output
    finally:
        kill_tree(job.pid)
    assert await latest_image(store_url, job.name, settings=ImageSettings()) is None
    await failing.inner.aclose()


async def test_a_store_failing_after_a_held_leave_running_job_went_on_leaves_it_running(
    criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path
) -> None:
    """With the image held in memory (``resume_buffer_mb``, by default) the job goes on
    before the store has it; a store that then fails fails the checkpoint, typed, and leaves
    the job running untouched and no image."""
    store_url = f"file://{tmp_path / 'store'}"
    failing = FailingStore(open_store(store_url), allow=2)
    job = await start_stream_job(job_script, tmp_path / "state", "resume-upload-fails")
    target = StreamTarget(failing, work_root=tmp_path / "work", writer_options=SMALL, settings=S)  # type: ignore[arg-type]
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    with pytest.raises((CheckpointError, StoreUnavailable)):
        await asyncio.wait_for(engine.freeze(job, target, Mode.RESUME), 60)
    assert target.manifest is None
    assert psutil.pid_exists(job.pid) and psutil.Process(job.pid).status() not in (
        "zombie",
        "stopped",
    )
    try:
        assert await wait_done(job.dir / "stdout") == reference_output
    finally:
        kill_tree(job.pid)
    assert await latest_image(store_url, job.name, settings=ImageSettings()) is None
    await failing.inner.aclose()


PIPE_MAX = Path("/proc/sys/fs/pipe-max-size")


@pytest.fixture
def small_pipe_limit() -> Any:
    """The kernel's default limit on an unprivileged pipe (1 MiB) for the test, restored after.

    Without CAP_SYS_RESOURCE (containers, and the GPU machines measured) a pipe cannot grow
    past ``fs.pipe-max-size``: every pipe of a stream was 1 MiB, and CRIU's restore waited on
    it (docs/benchmarks.md, "Pipe sizes")."""
    if os.geteuid() != 0 or not os.access(PIPE_MAX, os.W_OK):
        pytest.skip("needs root and a writable fs.pipe-max-size")
    before = PIPE_MAX.read_text()
    PIPE_MAX.write_text(str(1 << 20))
    yield
    PIPE_MAX.write_text(before)


@pytest.mark.serial  # changes fs.pipe-max-size, which every stream on the host reads
async def test_a_stream_raises_the_pipe_limit_and_criu_gets_pipes_of_the_set_size(
    criu_bin: str, job_script: Path, reference_output: str, tmp_path: Path, small_pipe_limit: Any
) -> None:
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    job = await start_stream_job(job_script, tmp_path / "state", "stream-pipes")
    settings = ImageSettings(pipe_mb=8)
    store = f"file://{tmp_path / 'store'}"
    work = tmp_path / "work"
    target = StreamTarget(store, work_root=work, writer_options=SMALL, settings=settings)
    await engine.freeze(job, target, Mode.EXIT)
    # raised (CRIU's page pipes then take it to 64 MiB: test_parallel_criu.py)
    assert int(await asyncio.to_thread(PIPE_MAX.read_text)) >= 8 << 20
    assert target.capture_stats is not None and target.capture_stats.pipe_bytes == 8 << 20
    assert target.url is not None
    source = StreamSource(target.url, settings=settings, work_root=tmp_path / "work")
    restored = await engine.restore(source, state_dir=tmp_path / "state")
    try:
        assert source.serve_stats is not None and source.serve_stats.pipe_bytes == 8 << 20
        assert await wait_done(job.dir / "stdout") == reference_output
    finally:
        kill_tree(restored.pid)


def test_the_pipe_limit_is_raised_to_the_size_asked_and_a_higher_one_never_lowered(
    tmp_path: Path,
) -> None:
    """On a file standing for the sysctl: the real one is host-wide, and tests on other
    workers stream at the same time."""
    from spotguard.stream.pipes import ensure_pipe_max

    limit = tmp_path / "pipe-max-size"
    limit.write_text(f"{1 << 20}\n")
    assert ensure_pipe_max(8 << 20, limit) == 8 << 20
    assert int(limit.read_text()) == 8 << 20  # raised, not beyond
    limit.write_text(str(32 << 20))
    assert ensure_pipe_max(8 << 20, limit) == 32 << 20
    assert int(limit.read_text()) == 32 << 20
    limit.write_text("junk")
    assert ensure_pipe_max(8 << 20, limit) == 0


#: a job that rewrites all of its 32 MiB without pause and, before each rewrite, checks that
#: every byte holds the generation it wrote last: an image with pages from two moments fails
#: the check right after its restore ("TORN")
REWRITER = """
import sys, time
n = 32 << 20
buf = bytearray(n)
gen = 0
end = time.time() + float(sys.argv[1])
print("started", flush=True)
while time.time() < end:
    if buf.count(gen % 251) != n:
        print(f"TORN at generation {gen}", flush=True)
        sys.exit(3)
    gen += 1
    buf[:] = bytes([gen % 251]) * n
    if gen % 20 == 0:
        print(f"generation {gen}", flush=True)
"""


async def test_a_leave_running_image_is_read_out_of_criu_before_the_job_goes_on(
    criu_bin: str, tmp_path: Path
) -> None:
    # CRIU splices the job's pages into the capture's pipes by reference: bytes still in a
    # pipe when a leave-running job goes on would be read as the job rewrites them. A slow
    # store (the gate) and a small capture buffer keep them there after CRIU has finished.
    script = tmp_path / "rewriter.py"
    script.write_text(REWRITER)
    store_url = f"file://{tmp_path / 'store'}"
    gated = GatedStore(open_store(store_url))
    engine = Engine(Criu(criu_bin), settings=CheckpointSettings())
    job = await start_job([sys.executable, str(script), "120"], "rewriter",
                          state_dir=tmp_path / "state")  # fmt: skip
    await wait_lines(job.dir / "stdout", 2)
    s = ImageSettings(pipe_mb=64)
    work = tmp_path / "work"
    target = StreamTarget(gated, work_root=work, writer_options=SMALL, settings=s,  # type: ignore[arg-type]
                          buffer_bytes=4 << 20)  # fmt: skip
    freeze = asyncio.create_task(engine.freeze(job, target, Mode.RESUME))
    await asyncio.wait_for(gated.blocked.wait(), 30)
    await asyncio.sleep(1.5)  # CRIU has put the rest into the pipes by now
    gated.gate.set()
    await asyncio.wait_for(freeze, 60)
    url = target.url
    assert url is not None
    kill_tree(job.pid)
    await asyncio.sleep(0.5)

    source = StreamSource(url, settings=ImageSettings(), work_root=tmp_path / "work2")
    restored = await engine.restore(source, state_dir=tmp_path / "state")
    try:
        await asyncio.sleep(1.5)  # a few generations: the first check comes at once
        out = (job.dir / "stdout").read_text()
        assert "TORN" not in out, out[-300:]
        assert psutil.pid_exists(restored.pid)
    finally:
        kill_tree(restored.pid)
    await gated.inner.aclose()
