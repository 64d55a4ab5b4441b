"""A job suspended in place can still be checkpointed — a notice does not wait for an unpark:
a leave-running checkpoint keeps it parked, an exit checkpoint makes an image that runs when
restored, and the stale park record then says where the job went instead of resuming a
process that is gone."""

from __future__ import annotations

import asyncio
import fcntl
import os
import sys
import time
from pathlib import Path

import pytest
from park_helpers import JOBS, Sg, ok_json

from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree, suspend
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.engine import Engine, Mode
from spotguard.checkpoint.jobs import resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.checkpoint.staging import DirectorySource, DirectoryTarget
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park import record
from spotguard.statedir import StateDir

pytestmark = pytest.mark.criu

STEPS = 150
EXPECTED = [f"step {i} {i * i} {i * 3}" for i in range(STEPS)] + ["done"]


def _lines(state_dir: Path) -> list[str]:
    p = StateDir(state_dir).job("pair") / "stdout"
    return p.read_text().splitlines() if p.exists() else []


async def test_notice_while_parked_in_place(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    gate = tmp_path / "go"
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS),
               str(gate)))  # fmt: skip
    deadline = time.monotonic() + 30
    while len(_lines(state_dir)) < 5:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    ok_json(sg("park", "pair", "--json"))
    job = resolve_job("pair", state_dir=state_dir)
    cs = CheckpointSettings(state_dir=state_dir, criu=criu_bin, criu_timeout=60)
    engine = Engine(Criu(criu_bin), settings=cs)
    at = len(_lines(state_dir))
    # a periodic (leave-running) checkpoint of a parked job leaves it parked
    await engine.freeze(job, DirectoryTarget(tmp_path / "periodic"), Mode.RESUME)
    assert all(suspend.stopped(p) for p in proctree.tree(job.pid))
    await asyncio.sleep(0.3)
    assert len(_lines(state_dir)) == at
    # the notice: exit checkpoint, then the job is restored (here, as on a new VM) and runs
    await engine.freeze(job, DirectoryTarget(tmp_path / "notice"), Mode.EXIT)
    assert not proctree.alive(job.pid)
    res = sg("unpark", "pair")
    assert res.returncode != 0 and "no longer parked here" in res.stderr
    assert record.load(state_dir, "pair") is None
    restored = await engine.restore(DirectorySource(tmp_path / "notice"), state_dir=state_dir)
    assert not suspend.stopped(restored.pid)
    gate.touch()
    deadline = time.monotonic() + 60
    while "done" not in _lines(state_dir):
        assert time.monotonic() < deadline, "the restored job does not run"
        await asyncio.sleep(0.05)
    assert _lines(state_dir) == EXPECTED


@pytest.mark.parametrize("place", ["tmpfs", "disk"])
async def test_a_notice_pushes_a_job_parked_on_the_node_to_the_store(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str, place: str
) -> None:
    """A job parked as an image in the node's tmpfs or on its disk has no process for a
    notice to checkpoint, and its state would go with the node. The agent pushes it to the
    store when the notice comes (signed and chunked like any image), the record then names the
    store image, and unparked from there the job ends exactly as an uninterrupted run."""
    gate = tmp_path / "go"
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS),
               str(gate)))  # fmt: skip
    deadline = time.monotonic() + 30
    while len(_lines(state_dir)) < 5:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    parked = ok_json(sg("park", "pair", "--to", place, "--json"))
    local = Path(parked["where"])
    assert parked["place"] == place and await asyncio.to_thread(local.is_dir)
    store = (tmp_path / "store").as_uri()
    agent = Agent(
        AgentSettings(job=["pair"], store=store, api_listen="127.0.0.1:0",
                      assignment=tmp_path / "no-assignment.json"),
        CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm"),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )  # fmt: skip
    task = asyncio.create_task(agent.run())
    try:
        deadline = time.monotonic() + 30
        while (w := agent.workers.get("pair")) is None or w.state != "parked":
            assert time.monotonic() < deadline, "the agent does not see the job parked"
            await asyncio.sleep(0.05)
        answer = await asyncio.wait_for(
            agent.drain("host maintenance", wait=True, deadline_s=None), 120
        )
        (line,) = answer["results"]
        assert line["job"] == "pair" and line["url"].startswith(store), line
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 60)
    rec = record.load(state_dir, "pair")
    assert rec is not None and (rec.place, rec.location) == ("store", line["url"])
    assert not await asyncio.to_thread(local.exists)  # the store holds the state now
    back = ok_json(sg("unpark", "pair", "--json"))
    assert back["place"] == "store"
    gate.touch()
    deadline = time.monotonic() + 60
    while "done" not in _lines(state_dir):
        assert time.monotonic() < deadline, "the unparked job does not run"
        await asyncio.sleep(0.05)
    assert _lines(state_dir) == EXPECTED


def _park_dumping(state_dir: Path, job: str) -> bool:
    """A park of ``job`` holds its park lock and CRIU has started writing its image."""
    lock = state_dir / "parked" / f"{job}.lock"
    images = state_dir / "parked" / "images" / job
    if not lock.exists() or not images.is_dir() or not any(images.glob("pages-*.img")):
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


async def test_a_notice_during_a_park_to_disk_carries_the_parked_image_to_the_store(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    """Issue 31 (13): a notice that comes while ``spotguard park --to disk`` dumps the job
    (another freeze is in progress) waits for the park, within the notice's deadline, then
    pushes the parked image to the store: the VM's disk is not where the job's state stays.
    Before, the notice's checkpoint was refused and never retried, and the image stayed on
    the node's disk."""
    ok_json(sg("run", "--name", "big", "--json", "--", sys.executable, JOBS, "big", "700"))
    out = state_dir / "jobs" / "big" / "stdout"
    deadline = time.monotonic() + 60
    while not (out.exists() and "holding" in out.read_text()):
        assert time.monotonic() < deadline, "the job does not start"
        await asyncio.sleep(0.1)
    store = (tmp_path / "store").as_uri()
    agent = Agent(
        AgentSettings(job=["big"], store=store, api_listen="127.0.0.1:0",
                      assignment=tmp_path / "no-assignment.json"),
        CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm",
                           criu_timeout=120),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )  # fmt: skip
    task = asyncio.create_task(agent.run())
    park = None
    try:
        deadline = time.monotonic() + 30
        while (w := agent.workers.get("big")) is None or w.state != "protecting":
            assert time.monotonic() < deadline, "the agent does not protect the job"
            await asyncio.sleep(0.05)
        park = asyncio.create_task(asyncio.to_thread(sg, "park", "big", "--to", "disk", "--json"))
        deadline = time.monotonic() + 60
        while not await asyncio.to_thread(_park_dumping, state_dir, "big"):
            assert not park.done(), f"the park ended before the notice: {park.result()}"
            assert time.monotonic() < deadline, "the park does not start dumping"
            await asyncio.sleep(0.02)
        started = time.monotonic()
        answer = await asyncio.wait_for(
            agent.drain("host maintenance", wait=True, deadline_s=120), 130
        )
        took = time.monotonic() - started
        parked = ok_json(await park)
        assert parked["place"] == "disk"  # the park itself finished as asked
        (line,) = answer["results"]
        assert line["job"] == "big" and str(line.get("url", "")).startswith(store), line
        assert took < 120, f"the image was durable only after {took:.1f}s"
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 60)
        if park is not None:
            await asyncio.wait_for(park, 120)
    rec = record.load(state_dir, "big")
    assert rec is not None and (rec.place, rec.location) == ("store", line["url"])
    assert not await asyncio.to_thread(Path(parked["where"]).exists)  # the node's copy is gone
    back = ok_json(sg("unpark", "big", "--json"))  # the store's image is whole: it restores
    assert back["place"] == "store" and proctree.alive(back["pid"])
