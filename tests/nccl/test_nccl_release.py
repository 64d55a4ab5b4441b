"""NCCL communicators released before a freeze and rebuilt after, with real processes and real
CRIU: a 4-rank job (a world communicator and a split of it, collectives at every step, a
watchdog thread asking for errors) runs under spotguard's shim on a fake NCCL (CPU)."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import Launch, lines, proc_state, wait_exit, wait_for

from conftest import Built
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.ncclctl import ENV_CTL, NcclControl, control_dir, shim_loaded
from spotguard.checkpoint.procfacts import read_environ
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.errors import CheckpointError, NcclError, SpotguardError, UndumpableError
from spotguard.park.core import park
from spotguard.park.settings import ParkSettings

pytestmark = pytest.mark.criu

RANKS, STEPS, STEP_MS = 4, 400, 10


def _settings(tmp_path: Path, criu_bin: str, lock_s: float = 10.0) -> CheckpointSettings:
    return CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin,
                              shm_dir=tmp_path / "shm", criu_timeout=60,
                              gpu_lock_timeout=lock_s)  # fmt: skip


def _reference(
    built: Built, tmp_path: Path, *flags: str, ranks: int = RANKS, steps: int = STEPS
) -> list[str]:
    """The job's output uninterrupted and without the shim (the fake NCCL alone)."""
    work = tmp_path / "ref"
    work.mkdir()
    done = subprocess.run([str(built.job), str(ranks), str(steps), "0", *flags],
                          env=built.env(work), capture_output=True, text=True, timeout=120,
                          check=True)  # fmt: skip
    return done.stdout.splitlines()


class FailAt:
    """The engine's faults seam (as tests/checkpoint's): raise before one named step."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.reached = False

    async def before(self, step: str) -> None:
        if step == self.step:
            self.reached = True
            raise CheckpointError(f"injected failure before {step}")


def _step(result_timeline: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The detail of step ``name``."""
    found: dict[str, Any] = next(s for s in result_timeline if s["name"] == name)["detail"]
    return found


def _log_count(tmp_path: Path, what: str) -> int:
    log = tmp_path / "nccl.log"
    return sum(1 for line in lines(log) if line.split()[1] == what)


async def _poll(cond: Callable[[], Awaitable[bool]], what: str, limit: float = 30.0) -> None:
    """Await ``cond`` every 20 ms until it is true; fail naming ``what`` after ``limit`` s."""
    deadline = asyncio.get_running_loop().time() + limit
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _running(job: JobInfo) -> None:
    out = job.dir / "stdout"
    n = len(lines(out))
    await wait_for(lambda: len(lines(out)) > n + 3, f"job {job.name} to go on")


async def test_communicators_are_released_and_rebuilt_through_pause_exit_and_restore(
    built: Built,
    launch_shim: Launch,
    criu_bin: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    want = _reference(built, tmp_path)
    assert len(want) == STEPS + 1
    job = await launch_shim([str(built.job), str(RANKS), str(STEPS), str(STEP_MS)], "ranks")
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 5, "the job's first steps")
    ranks = [p for p in proctree.tree(job.pid) if shim_loaded(p)]
    assert len(ranks) == RANKS + 2  # the job's init and the launcher too (no communicator)
    env = read_environ(ranks[-1])
    assert env["LD_PRELOAD"].split()[0] == str(built.shim)
    assert env[ENV_CTL] == str(control_dir("ranks"))
    assert "NCCL_P2P_DISABLE" not in env  # NCCL keeps its own transport choices
    engine = Engine(Criu(criu_bin), settings=_settings(tmp_path, criu_bin))
    caplog.set_level(logging.INFO, logger="spotguard.checkpoint.ncclctl")

    paused = await engine.freeze(job, DirectoryTarget(tmp_path / "img-pause"), Mode.RESUME)
    timeline = paused.timeline.to_list()
    assert _step(timeline, "nccl_release")["communicators"] == 2 * RANKS
    assert _step(timeline, "nccl_rebuild")["communicators"] == 2 * RANKS
    assert _log_count(tmp_path, "finalize") == 2 * RANKS
    assert _log_count(tmp_path, "destroy") == 2 * RANKS
    # each with its communicator's device current, never a new context on another GPU
    assert _log_count(tmp_path, "wrong-device") == 0
    # the world once by the job; world and split again by the rebuild, from fresh ids
    assert _log_count(tmp_path, "init") == RANKS + 2 * RANKS
    assert _log_count(tmp_path, "split") == RANKS
    await _running(job)

    parked = await engine.freeze(job, DirectoryTarget(tmp_path / "img-park"), Mode.EXIT)
    assert _step(parked.timeline.to_list(), "nccl_release")["communicators"] == 2 * RANKS
    await wait_for(lambda: not proctree.alive(job.pid), "the job to stop")
    restored = await engine.restore(DirectorySource(tmp_path / "img-park"))
    assert _step(restored.timeline.to_list(), "nccl_rebuild")["communicators"] == 2 * RANKS
    assert await wait_exit(restored.job, 120) == 0, (job.dir / "stderr").read_text()
    assert lines(out) == want
    msgs = [r for r in caplog.records if r.getMessage().startswith("NCCL communicators")]
    assert [r.getMessage() for r in msgs] == [
        "NCCL communicators released",
        "NCCL communicators rebuilt",
        "NCCL communicators released",
        "NCCL communicators rebuilt",
    ]
    assert all(getattr(r, "communicators") == 2 * RANKS for r in msgs)  # noqa: B009


async def test_a_rank_stuck_inside_a_collective_fails_the_checkpoint_and_the_job_runs_on(
    built: Built, launch_shim: Launch, criu_bin: str, tmp_path: Path
) -> None:
    want = _reference(built, tmp_path)
    hold = tmp_path / "hold"
    env = built.env(tmp_path, FAKE_NCCL_HOLD=str(hold), FAKE_NCCL_HOLD_RANK="1")
    argv = [str(built.job), str(RANKS), str(STEPS // 2), str(STEP_MS)]
    job = await launch_shim(argv, "stuck", env)
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 5, "the job's first steps")
    hold.touch()  # rank 1 stays inside its next collective; its peers wait inside theirs
    engine = Engine(Criu(criu_bin), settings=_settings(tmp_path, criu_bin, lock_s=2))
    with pytest.raises(NcclError) as err:
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    text = str(err.value)
    assert "\n" not in text
    assert "did not quiesce in 2 s" in text and "inside an NCCL call" in text, text
    assert "the job runs on" in text
    assert not (tmp_path / "img" / "spotguard-image.json").exists()
    # parked in memory: the same refusal, in one line, before the GPU lock; nothing stopped
    with pytest.raises(NcclError, match="did not quiesce in 2 s") as err:
        await park(job, to="memory", engine=engine, settings=engine.settings,
                   park_settings=ParkSettings())  # fmt: skip
    assert "\n" not in str(err.value)
    assert not any(proc_state(p) == "T" for p in proctree.tree(job.pid))
    hold.unlink()
    assert await wait_exit(job, 120) == 0, (job.dir / "stderr").read_text()
    assert lines(out) == [*want[: STEPS // 2], "done"]
    assert _log_count(tmp_path, "finalize") == 0  # nothing was released


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--register", "ncclCommRegister"),
        ("--capture", "captured in a CUDA graph"),
        ("--window", "NCCL memory windows (ncclCommWindowRegister)"),
        ("--devcomm", "NCCL's device API (ncclDevCommCreate)"),
        ("--memalloc", "1 buffers from ncclMemAlloc"),
    ],
)
async def test_what_cannot_be_released_is_refused_by_name(
    flag: str, named: str, built: Built, launch_shim: Launch, criu_bin: str, tmp_path: Path
) -> None:
    # STEPS (4 s): a 60-step job (0.6 s) had ended on a slow run before it could "go on"
    argv = [str(built.job), str(RANKS), str(STEPS), str(STEP_MS), flag]
    job = await launch_shim(argv, f"refused{flag.replace('-', '')}")
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 3, "the job's first steps")
    engine = Engine(Criu(criu_bin), settings=_settings(tmp_path, criu_bin))
    with pytest.raises(UndumpableError, match=re.escape(named)) as err:
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    # named per rank (ncclMemAlloc memory is the process's, not a communicator's)
    assert "rank 0 of 4" in str(err.value) or flag == "--memalloc"
    assert "--nccl restrict" in str(err.value)
    await _running(job)
    assert await wait_exit(job, 60) == 0
    assert _log_count(tmp_path, "finalize") == 0


async def test_a_communicator_with_a_rank_outside_the_job_is_refused(
    built: Built, launch_shim: Launch, criu_bin: str, tmp_path: Path
) -> None:
    """Rank 3 of the world runs in a process outside the job (as on another VM): spotguard
    could not rebuild that communicator, so the freeze refuses it, naming it; the job runs on."""
    world = tmp_path / "world"
    world.mkdir()  # the shared ncclUniqueId: the fake NCCL's rendezvous directory
    env = built.env(tmp_path, NCCL_JOB_ID=str(world))
    steps = ["60", str(STEP_MS)]
    outside = await asyncio.create_subprocess_exec(
        str(built.job), str(RANKS), *steps, "--only-rank", "3", env=env,
        stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        job = await launch_shim([str(built.job), str(RANKS), *steps, "--skip-rank", "3"],
                                "spans", env)  # fmt: skip
        out = job.dir / "stdout"
        await wait_for(lambda: len(lines(out)) > 3, "the job's first steps")
        engine = Engine(Criu(criu_bin), settings=_settings(tmp_path, criu_bin))
        with pytest.raises(UndumpableError) as err:
            await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
        text = str(err.value)
        assert "has 3 of its 4 ranks in this job (ranks 0, 1, 2)" in text, text
        assert "has 1 of its 2 ranks in this job (ranks 0)" in text, text  # the odd half
        await _running(job)
        assert await wait_exit(job, 60) == 0
        assert await asyncio.wait_for(outside.wait(), 60) == 0
        assert _log_count(tmp_path, "finalize") == 0
    finally:
        if outside.returncode is None:
            outside.kill()
            await outside.wait()


async def test_a_freeze_or_park_failing_after_the_release_rebuilds_the_communicators(
    built: Built,
    launch_shim: Launch,
    criu_bin: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 4 s of steps: a 1.5 s job had ended (its communicators destroyed at its end) before a
    # loaded clean-clone run counted the release's destroys
    ranks, steps = 2, STEPS
    want = _reference(built, tmp_path, ranks=ranks, steps=steps)
    job = await launch_shim([str(built.job), str(ranks), str(steps), str(STEP_MS)], "failed")
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 5, "the job's first steps")
    caplog.set_level(logging.INFO, logger="spotguard.checkpoint.ncclctl")
    settings = _settings(tmp_path, criu_bin)
    dump = FailAt("criu_dump")  # after nccl_release
    engine = Engine(Criu(criu_bin), settings=settings, faults=dump)
    with pytest.raises(CheckpointError, match="injected failure before criu_dump"):
        await engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT)
    assert dump.reached
    assert _log_count(tmp_path, "destroy") == 2 * ranks  # released, then brought back:
    assert _log_count(tmp_path, "init") == ranks + 2 * ranks  # rebuilt from fresh ids
    await _running(job)
    stop = FailAt("stop")  # parked in memory: after nccl_release and the GPU steps
    engine = Engine(Criu(criu_bin), settings=settings, faults=stop)
    with pytest.raises(SpotguardError, match="injected failure before stop"):
        await park(job, to="memory", engine=engine, settings=settings,
                   park_settings=ParkSettings())  # fmt: skip
    assert stop.reached
    assert _log_count(tmp_path, "destroy") == 4 * ranks
    assert _log_count(tmp_path, "init") == ranks + 4 * ranks
    assert await wait_exit(job, 60) == 0, (job.dir / "stderr").read_text()
    assert lines(out) == want
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("NCCL comm")]
    assert msgs == ["NCCL communicators released", "NCCL communicators rebuilt"] * 2


async def test_a_rank_owing_a_collective_behind_one_on_another_communicator_is_let_through(
    built: Built, launch_shim: Launch, criu_bin: str, tmp_path: Path
) -> None:
    """Rank 0 has done the step's first world all-reduce and is held; rank 1 has gone on
    through its own one-rank half communicator into the step's second world all-reduce, where
    it waits for rank 0. The gate closes, then rank 0 is let go: to reach the world call it
    owes it must first pass a call on its half communicator, where it owes nothing. The
    drain lets it (it still owes something) instead of holding it there for good — before,
    the freeze failed with "did not quiesce" (1 in ~10 tries under load in CI, every time
    here)."""
    ranks, steps = 2, 150
    want = _reference(built, tmp_path, ranks=ranks, steps=steps)
    hold = tmp_path / "hold"
    env = built.env(
        tmp_path, FAKE_NCCL_HOLD=str(hold), FAKE_NCCL_HOLD_RANK="0", FAKE_NCCL_HOLD_AFTER="24"
    )  # 24 bytes on a 2-rank communicator: the first world all-reduce of a step
    job = await launch_shim([str(built.job), str(ranks), str(steps), str(STEP_MS)], "owes", env)
    out = job.dir / "stdout"
    await wait_for(lambda: len(lines(out)) > 5, "the job's first steps")
    hold.touch()
    nccl = NcclControl()

    async def inside() -> bool:  # both ranks inside a call: 0 held, 1 waiting for it
        members = await nccl.members(proctree.tree(job.pid))
        return len(members) == ranks and all(m.inflight for m in members)

    await _poll(inside, "both ranks inside a collective")
    settings = _settings(tmp_path, criu_bin, lock_s=10.0)
    dump = FailAt("criu_dump")  # after nccl_release: the release is what is tested
    engine = Engine(Criu(criu_bin), settings=settings, faults=dump)
    freeze = asyncio.create_task(engine.freeze(job, DirectoryTarget(tmp_path / "img"), Mode.EXIT))

    async def gate_closed() -> bool:
        if freeze.done():  # it ended before the gate closed: say why (await raises it)
            await freeze
            pytest.fail("the freeze ended before the gate closed")
        members = await nccl.members(proctree.tree(job.pid))
        return bool(members) and all(m.state != "open" for m in members)

    await _poll(gate_closed, "the gate closed")
    hold.unlink()  # rank 0 returns and goes on to its half communicator's call
    with pytest.raises(CheckpointError, match="injected failure before criu_dump"):
        await freeze
    assert _log_count(tmp_path, "destroy") == 2 * ranks  # world and half of each, released
    assert await wait_exit(job, 60) == 0, (job.dir / "stderr").read_text()
    assert lines(out) == want
