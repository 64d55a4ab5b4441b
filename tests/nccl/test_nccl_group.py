"""NCCL communicators whose ranks span VMs, released and rebuilt together by the agents of
the VMs through a real controller's group routes (the rendezvous). One 4-rank run split over
two jobs as over two VMs — ranks 0-2 in one (``--skip-rank 3``), rank 3 in the other
(``--only-rank 3``), both started with the same ``--nccl-group`` — each checkpointed by its
own engine ("agent"), with real CRIU, on the fake NCCL (CPU)."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import Launch, lines, wait_exit, wait_for

from conftest import Built
from spotguard.agent.groups import ControllerPeers
from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import JobInfo
from spotguard.checkpoint.ncclctl import NcclControl
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.controller.client import ControllerClient
from spotguard.controller.server import ControllerServer
from spotguard.errors import NcclError, UndumpableError
from spotguard.groupwire import GROUP_ENV
from spotguard.image import ImageSettings

sys.path.insert(0, str(Path(__file__).parents[1] / "controller"))
from controller_helpers import TOKEN, local, settings

pytestmark = pytest.mark.criu

RANKS, STEPS, STEP_MS = 4, 300, 10
GROUP = "trainer"


@dataclass
class Split:
    """The two halves of one run, the controller and one engine per half ("VM")."""

    a: JobInfo  # ranks 0, 1, 2 (rank 0 prints)
    b: JobInfo  # rank 3
    url: str
    want: list[str]
    engines: dict[str, Engine]


def _settings(tmp_path: Path, criu_bin: str, vm: str) -> CheckpointSettings:
    return CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin,
                              shm_dir=tmp_path / f"shm-{vm}", criu_timeout=60,
                              gpu_lock_timeout=10.0)  # fmt: skip


def _engine(tmp_path: Path, criu_bin: str, vm: str, url: str | None, join_s: float) -> Engine:
    def peers(group: str, job: str) -> ControllerPeers | None:
        return ControllerPeers(ControllerClient(url, TOKEN), group, job) if url else None

    s = _settings(tmp_path, criu_bin, vm)
    nccl = NcclControl(call_timeout=60.0, peers=peers, group_join_s=join_s, group_wait_s=60.0)
    return Engine(Criu(criu_bin), settings=s, nccl=nccl)


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[str]:
    srv = ControllerServer(settings(tmp_path), provider=local(tmp_path),
                           image=ImageSettings.model_validate({}))  # fmt: skip
    await srv.__aenter__()
    try:
        yield srv.url
    finally:
        await srv.__aexit__(None, None, None)


@pytest.fixture
async def split(
    built: Built, launch_shim: Launch, criu_bin: str, tmp_path: Path, controller: str
) -> Callable[..., Any]:
    async def make(group: str | None = GROUP, url: str | None = controller,
                   join_s: float = 20.0) -> Split:  # fmt: skip
        ref = tmp_path / "ref"
        ref.mkdir(exist_ok=True)
        done = await asyncio.create_subprocess_exec(
            str(built.job), str(RANKS), str(STEPS), "0", env=built.env(ref),
            stdout=asyncio.subprocess.PIPE)  # fmt: skip
        want = (await done.communicate())[0].decode().splitlines()
        world = tmp_path / "world"
        world.mkdir()  # the fake NCCL's rendezvous directory for the first ncclUniqueId
        extra = {"NCCL_JOB_ID": str(world), **({GROUP_ENV: group} if group else {})}
        env = built.env(tmp_path, **extra)
        steps = [str(STEPS), str(STEP_MS)]
        a = await launch_shim([str(built.job), str(RANKS), *steps, "--skip-rank", "3"], "a", env)
        b = await launch_shim([str(built.job), str(RANKS), *steps, "--only-rank", "3"], "b", env)
        await wait_for(lambda: len(lines(a.dir / "stdout")) > 5, "the run's first steps")
        engines = {v: _engine(tmp_path, criu_bin, v, url, join_s) for v in ("a", "b")}
        return Split(a, b, controller, want, engines)

    return make


def _step(result: Any, name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(s for s in result.timeline.to_list() if s["name"] == name)[
        "detail"
    ]
    return found


async def _going_on(job: JobInfo) -> None:
    out = job.dir / "stdout"
    n = len(lines(out))
    await wait_for(lambda: len(lines(out)) > n + 3, f"job {job.name} to go on")


async def test_a_run_over_two_vms_is_released_together_exits_and_restores_byte_identical(
    split: Callable[..., Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both halves frozen at once (exit), each by its own agent: the communicators that span
    them are levelled and released through the controller; both restored, they meet again
    there for fresh ids, and the run ends with exactly the uninterrupted output."""
    s: Split = await split()
    caplog.set_level(logging.INFO, logger="spotguard")
    got = await asyncio.gather(
        s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / "img-a"), Mode.EXIT),
        s.engines["b"].freeze(s.b, DirectoryTarget(tmp_path / "img-b"), Mode.EXIT),
    )
    assert _step(got[0], "nccl_release")["communicators"] == 6  # world x 3, halves x 3
    assert _step(got[1], "nccl_release")["communicators"] == 2
    for j in (s.a, s.b):
        await wait_for(lambda j=j: not proctree.alive(j.pid), f"job {j.name} to stop")
    back = await asyncio.gather(
        s.engines["a"].restore(DirectorySource(tmp_path / "img-a")),
        s.engines["b"].restore(DirectorySource(tmp_path / "img-b")),
    )
    assert _step(back[0], "nccl_rebuild")["communicators"] == 6
    assert _step(back[1], "nccl_rebuild")["communicators"] == 2
    assert await wait_exit(back[0].job, 120) == 0, (s.a.dir / "stderr").read_text()
    assert await wait_exit(back[1].job, 120) == 0, (s.b.dir / "stderr").read_text()
    assert lines(s.a.dir / "stdout") == s.want
    met = [r for r in caplog.records if r.getMessage() == "NCCL group rebuild met"]
    assert sorted(getattr(r, "job") for r in met) == ["a", "b"]  # noqa: B009
    assert all(getattr(r, "jobs") == ["a", "b"] for r in met)  # noqa: B009


async def test_a_run_over_two_vms_paused_together_runs_on_byte_identical(
    split: Callable[..., Any], tmp_path: Path
) -> None:
    """Leave-running, twice in a row: released, imaged and rebuilt in the same generation,
    then again in the next (no round of the first answers the second)."""
    s: Split = await split()
    for n in range(2):
        got = await asyncio.gather(
            s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / f"p{n}-a"), Mode.RESUME),
            s.engines["b"].freeze(s.b, DirectoryTarget(tmp_path / f"p{n}-b"), Mode.RESUME),
        )
        assert [_step(g, "nccl_rebuild")["communicators"] for g in got] == [6, 2]
        await _going_on(s.a)
    assert await wait_exit(s.a, 120) == 0
    assert await wait_exit(s.b, 120) == 0
    assert lines(s.a.dir / "stdout") == s.want


async def test_a_member_whose_agent_never_comes_fails_the_freeze_and_the_run_goes_on(
    split: Callable[..., Any], tmp_path: Path
) -> None:
    """Only one half is checkpointed (the other VM's agent is gone): its freeze waits for
    the other at the controller, then fails in one line naming the round; every gate opens
    again and the run ends with the uninterrupted output."""
    s: Split = await split(join_s=2.0)
    with pytest.raises(NcclError) as err:
        await s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / "img-a"), Mode.EXIT)
    text = str(err.value)
    assert f"NCCL group {GROUP!r}: round g1-r0 did not fill" in text, text
    assert "(jobs there: a)" in text, text
    assert "\n" not in text
    await _going_on(s.a)
    assert await wait_exit(s.a, 120) == 0
    assert await wait_exit(s.b, 120) == 0
    assert lines(s.a.dir / "stdout") == s.want


@pytest.mark.parametrize("case", ["no group", "no controller"])
async def test_spanning_communicators_without_a_group_or_a_controller_are_refused(
    split: Callable[..., Any], tmp_path: Path, case: str
) -> None:
    """Without ``--nccl-group``, or on an agent without a controller, no one can meet the
    other half: refused before any lock, naming how to run it; the run goes on."""
    s: Split = await (split(group=None) if case == "no group" else split(url=None))
    with pytest.raises(UndumpableError) as err:
        await s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / "img-a"), Mode.EXIT)
    assert "has 3 of its 4 ranks in this job" in str(err.value)
    assert "spotguard run --nccl-group NAME' under a controller" in str(err.value)
    await _going_on(s.a)
    assert await wait_exit(s.a, 120) == 0
    assert lines(s.a.dir / "stdout") == s.want


async def test_a_pause_of_one_member_gives_way_to_an_exit_of_another(
    split: Callable[..., Any], tmp_path: Path
) -> None:
    """One VM pauses (a rebalance) while the other's spot notice stops the group: the exit
    opens the next generation, the pause fails fast ("superseded") and opens its gates, and
    its agent follows the exit (as its group watch makes it drain); both halves then exit,
    restore and end byte-identical."""
    s: Split = await split()
    pause = asyncio.create_task(
        s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / "pause-a"), Mode.RESUME)
    )
    await asyncio.sleep(0.5)  # a's pause has opened generation 1 and waits for b there
    exit_b = asyncio.create_task(
        s.engines["b"].freeze(s.b, DirectoryTarget(tmp_path / "img-b"), Mode.EXIT)
    )
    with pytest.raises(NcclError, match="superseded by generation 2; this freeze gives way"):
        await asyncio.wait_for(pause, 15)
    exit_a = await s.engines["a"].freeze(s.a, DirectoryTarget(tmp_path / "img-a"), Mode.EXIT)
    assert _step(exit_a, "nccl_release")["communicators"] == 6
    assert _step(await exit_b, "nccl_release")["communicators"] == 2
    for j in (s.a, s.b):
        await wait_for(lambda j=j: not proctree.alive(j.pid), f"job {j.name} to stop")
    back = await asyncio.gather(
        s.engines["a"].restore(DirectorySource(tmp_path / "img-a")),
        s.engines["b"].restore(DirectorySource(tmp_path / "img-b")),
    )
    assert await wait_exit(back[0].job, 120) == 0
    assert await wait_exit(back[1].job, 120) == 0
    assert lines(s.a.dir / "stdout") == s.want
