"""spotguard's CRIU plugin with real CRIU: leftover device references of processes with no
GPU context (DataLoader workers forked from a CUDA process) are parked and unparked.

This machine has no /dev/nvidia*, so the plugin is pointed (SPOTGUARD_CRIU_LEFTOVER_DEVICES,
through ``Criu(leftover_devices=...)``) at devices CRIU cannot dump on its own, exactly as it
cannot dump /dev/nvidia*: /dev/fuse for the fd path (CRIU: "Can't dump file ... of that type")
and a loop block device, which supports mmap, for the mapping path (CRIU: "Can't handle
non-regular mapping", the error forked DataLoader workers give).

The job has the shape of a trainer with a worker: the parent opens the device (and maps it),
forks a worker that inherits both, then drops its own references (as the driver checkpoint
does for the CUDA process). The worker counts to N, one line a step, and at the end reports
what its inherited fd and mapping are.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from ckpt_helpers import Launch, lines, progresses, wait_exit, wait_for

from spotguard.checkpoint import proctree, scan
from spotguard.checkpoint.criu import PLUGIN_NAME, Criu, find_plugin_dir
from spotguard.checkpoint.doctor import run_checks
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.meta import META_NAME
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CriuError
from spotguard.image import ImageSettings, generate_signing_key
from spotguard.image.catalog import latest_image
from spotguard.stream import StreamSource, StreamTarget

pytestmark = pytest.mark.criu

REQUIRE = os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1"
#: what the worker reports after restore: an inert fd, the mapping at its address with its
#: protection but over an empty memfd, and touching it is a loud SIGBUS, never zeros
PLACEHOLDER = ["fd /dev/null", "map rw-s /memfd:spotguard-leftover (deleted)", "touch signal 7"]
STEPS = 60

WORKER_JOB = textwrap.dedent(
    """
    import ctypes, mmap, os, sys, time
    device, steps, want_map = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "map"
    fd = os.open(device, os.O_RDWR)
    addr = None
    if want_map:
        m = mmap.mmap(fd, 65536, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        for line in open("/proc/self/maps"):
            if device in line:
                addr = line.split("-")[0]
    pid = os.fork()
    if pid == 0:
        with open("worker.log", "a") as log:
            for i in range(1, steps + 1):
                print(f"worker {i}", file=log, flush=True)
                time.sleep(0.05)
            print("fd", os.readlink(f"/proc/self/fd/{fd}"), file=log)
            if addr:
                maps = [ln for ln in open("/proc/self/maps") if ln.startswith(addr + "-")]
                print("map", maps[0].split()[1], maps[0].split(None, 5)[5].strip(), file=log)
                probe = os.fork()  # what touching the inherited mapping does now
                if probe == 0:
                    ctypes.string_at(int(addr, 16), 1)
                    os._exit(0)
                _, st = os.waitpid(probe, 0)
                touch = f"signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else "readable"
                print("touch", touch, file=log)
        os._exit(0)
    if want_map:
        m.close()  # the driver's checkpoint releases the CUDA process's device references
    os.close(fd)
    _, status = os.waitpid(pid, 0)
    print("parent done, worker status", status, flush=True)
    """
)


def _need(msg: str) -> None:
    if REQUIRE:
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def plugin_dir(criu_bin: str) -> Path:
    found = find_plugin_dir(criu_bin)
    if found is None:
        _need(f"{PLUGIN_NAME}.so is not installed next to {criu_bin} (run scripts/install-criu)")
    assert found is not None
    return found


@pytest.fixture
def fuse_device() -> str:
    if not os.path.exists("/dev/fuse"):
        _need("no /dev/fuse on this machine")
    return "/dev/fuse"


@pytest.fixture
def loop_device(tmp_path: Path, launch: Launch) -> Iterator[str]:
    """A loop block device over a 1 MiB file: mmap-able, and CRIU cannot map it itself.
    (Depends on ``launch`` so the jobs holding it are gone before it is detached.)"""
    backing = tmp_path / "loop-backing"
    backing.write_bytes(b"\0" * (1 << 20))
    out = subprocess.run(
        ["losetup", "--find", "--show", str(backing)], capture_output=True, text=True
    )
    if out.returncode != 0:
        _need(f"cannot set up a loop device: {out.stderr.strip()}")
    dev = out.stdout.strip()
    try:
        yield dev
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["losetup", "--detach", dev], check=False)


def _engine(
    settings: CheckpointSettings, criu_bin: str, device: str, plugins: Literal["auto"] | None
) -> Engine:
    """The engine ``spotguard`` builds, with the plugin (``"auto"``) or with none at all."""
    criu = Criu(criu_bin, plugins=plugins, leftover_devices=[device])
    return Engine(criu, settings=settings)


async def _start(
    launch: Launch, tmp_path: Path, device: str, mode: str, name: str
) -> tuple[JobInfo, Path]:
    work = tmp_path / "work"
    work.mkdir()
    script = tmp_path / "workers.py"
    script.write_text(WORKER_JOB)
    job = await launch([sys.executable, str(script), device, str(STEPS), mode], name, cwd=work)
    await wait_for(lambda: len(lines(work / "worker.log")) > 5, "the worker to log")
    return job, work


def _worker_counted_exactly(work: Path) -> list[str]:
    log = lines(work / "worker.log")
    assert log[:STEPS] == [f"worker {i}" for i in range(1, STEPS + 1)]
    return log[STEPS:]


async def test_without_the_plugin_a_leftover_device_fd_fails_the_dump_and_the_job_resumes(
    settings: CheckpointSettings, criu_bin: str, launch: Launch, tmp_path: Path, fuse_device: str
) -> None:
    job, work = await _start(launch, tmp_path, fuse_device, "fd", "leftover-noplugin")
    engine = _engine(settings, criu_bin, fuse_device, None)
    with pytest.raises(CriuError) as err:
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    assert "Can't dump file" in str(err.value.log_tail)
    assert proctree.alive(job.pid)
    await progresses(work / "worker.log")
    assert await wait_exit(job) == 0
    assert _worker_counted_exactly(work) == [f"fd {fuse_device}"]


async def test_leftover_device_fd_of_a_forked_worker_is_parked_and_unparked(
    settings: CheckpointSettings,
    criu_bin: str,
    plugin_dir: Path,
    launch: Launch,
    tmp_path: Path,
    fuse_device: str,
) -> None:
    job, work = await _start(launch, tmp_path, fuse_device, "fd", "leftover-fd")
    engine = _engine(settings, criu_bin, fuse_device, "auto")
    assert engine.criu.plugin_dir == plugin_dir
    result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")
    dump_log = (result.images_dir / "criu-dump.log").read_text()
    assert f"leftover device fd {fuse_device}" in dump_log

    restored = await engine.restore(DirectorySource(result.images_dir))
    assert await wait_exit(restored.job) == 0
    # the worker counted on without a gap or a repeat; its inherited fd is now inert
    assert _worker_counted_exactly(work) == ["fd /dev/null"]
    assert lines(job.dir / "stdout") == ["parent done, worker status 0"]


async def test_leftover_device_mapping_of_a_forked_worker_becomes_an_inaccessible_placeholder(
    settings: CheckpointSettings,
    criu_bin: str,
    plugin_dir: Path,
    launch: Launch,
    tmp_path: Path,
    loop_device: str,
) -> None:
    job, work = await _start(launch, tmp_path, loop_device, "map", "leftover-map")
    engine = _engine(settings, criu_bin, loop_device, "auto")
    result = await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")
    dump_log = (result.images_dir / "criu-dump.log").read_text()
    assert f"leftover mapping of {loop_device}" in dump_log

    restored = await engine.restore(DirectorySource(result.images_dir))
    assert await wait_exit(restored.job) == 0
    assert _worker_counted_exactly(work) == PLACEHOLDER
    assert lines(job.dir / "stdout") == ["parent done, worker status 0"]


async def test_an_image_that_needs_the_plugin_is_not_restored_without_it_and_is_kept(
    settings: CheckpointSettings,
    criu_bin: str,
    plugin_dir: Path,
    launch: Launch,
    tmp_path: Path,
    loop_device: str,
) -> None:
    job, work = await _start(launch, tmp_path, loop_device, "map", "leftover-needs-plugin")
    with_plugin = _engine(settings, criu_bin, loop_device, "auto")
    result = await with_plugin.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")

    without = _engine(settings, criu_bin, loop_device, None)
    with pytest.raises(CriuError) as err:
        await without.restore(DirectorySource(result.images_dir))
    assert f"Missing required plugin: {PLUGIN_NAME}" in str(err.value.log_tail)
    assert (result.images_dir / META_NAME).exists(), "a complete image is never lost"

    restored = await with_plugin.restore(DirectorySource(result.images_dir))
    assert await wait_exit(restored.job) == 0
    assert _worker_counted_exactly(work)[0] == "fd /dev/null"


@pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")
async def test_leftover_references_go_through_a_streamed_image(
    settings: CheckpointSettings,
    criu_bin: str,
    plugin_dir: Path,
    launch: Launch,
    tmp_path: Path,
    loop_device: str,
) -> None:
    """The plugin keeps no files of its own: its inventory entry travels in CRIU's images,
    so the streamed path (store URL, no staging directory) works the same."""
    job, work = await _start(launch, tmp_path, loop_device, "map", "leftover-stream")
    engine = _engine(settings, criu_bin, loop_device, "auto")
    store = f"file://{tmp_path / 'store'}"
    # signed: the job's worker log lives outside its directory, which only an authenticated
    # image may put back (docs/security.md)
    private, public = generate_signing_key()
    (tmp_path / "k").write_bytes(private)
    (tmp_path / "k.pub").write_bytes(public)
    agent = ImageSettings(signing_key_file=tmp_path / "k")
    host = ImageSettings(verify_key_file=tmp_path / "k.pub")
    target = StreamTarget(store, work_root=tmp_path / "stream-work", settings=agent)
    await engine.freeze(job, target, Mode.EXIT)
    await wait_for(lambda: not proctree.alive(job.pid), "the job to be stopped")
    url = await latest_image(store, job.name, settings=host)
    assert url is not None

    without = _engine(settings, criu_bin, loop_device, None)
    with pytest.raises(CriuError, match=f"Missing required plugin: {PLUGIN_NAME}"):
        await without.restore(StreamSource(url, work_root=tmp_path / "stream-work", settings=host))
    restored = await engine.restore(
        StreamSource(url, work_root=tmp_path / "stream-work", settings=host)
    )
    assert await wait_exit(restored.job) == 0
    assert _worker_counted_exactly(work) == PLACEHOLDER


async def test_doctor_checks_the_version_and_reports_the_plugin(
    criu_bin: str, plugin_dir: Path, tmp_path: Path
) -> None:
    checks = {c.name: c for c in await run_checks(criu_bin)}
    assert checks["criu"].ok
    assert checks["criu plugin"].ok
    assert checks["criu plugin"].found == str(plugin_dir / f"{PLUGIN_NAME}.so")

    old = tmp_path / "old" / "bin" / "criu"  # a 4.1.1 with no plugin beside it
    old.parent.mkdir(parents=True)
    old.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Version: 4.1.1"\nexit 0\n')
    old.chmod(0o755)
    checks = {c.name: c for c in await run_checks(str(old))}
    assert not checks["criu"].ok
    assert checks["criu"].fix == "CRIU >= 4.2.1 needed: run: sudo spotguard install-criu"
    assert not checks["criu plugin"].ok and not checks["criu plugin"].required
    assert "sudo spotguard install-criu" in checks["criu plugin"].fix


async def test_doctor_names_the_patches_a_criu_lacks(criu_bin: str, tmp_path: Path) -> None:
    """A CRIU installed before a patch was added (or Debian's own) still dumps, one process
    after another: the doctor says which of spotguard's patches it lacks and how to get
    them, without failing the host."""
    checks = {c.name: c for c in await run_checks(criu_bin, self_test=False)}
    assert checks["criu patches"].ok, checks["criu patches"]
    stale = tmp_path / "stale" / "bin" / "criu"  # page workers and external pages, no 0006
    stale.parent.mkdir(parents=True)
    stale.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && echo "Version: 4.2.1" && exit 0\n'
        'echo "  --page-workers N  write the pages of up to N tasks at once"\n'
        'echo "  --external-pages PID:START-END  leave a range to the caller"\n'
    )
    stale.chmod(0o755)
    patches = {c.name: c for c in await run_checks(str(stale), self_test=False)}["criu patches"]
    assert not patches.ok and not patches.required
    assert "several tasks' pages drained at once" in patches.found, patches.found
    assert "--page-workers" not in patches.found.split("lacks")[-1], patches.found
    assert "sudo spotguard install-criu" in patches.fix


def test_the_preflight_lets_through_mappings_the_plugin_dumps() -> None:
    maps = ("/usr/lib/libc.so.6", "/dev/loop3", "/dev/nvidia0")
    refused = scan.ProcFacts(pid=9, name="worker", maps=maps)
    assert [f.resource.split(" (")[0] for f in scan.devices(refused)] == [
        "a mapping of the device /dev/loop3",
        "a leftover mapping of /dev/nvidia0",  # no CUDA state and no plugin to carry it
    ]
    plugin = ("/dev/loop", "/dev/nvidia")
    allowed = scan.ProcFacts(pid=9, name="worker", maps=maps, plugin_devices=plugin)
    assert scan.devices(allowed) == []
