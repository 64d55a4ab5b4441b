"""A job suspended in place can still be checkpointed — a notice does not wait for an unpark:
a leave-running checkpoint keeps it parked, an exit checkpoint makes an image that runs when
restored, and the stale park record then says where the job went instead of resuming a
process that is gone."""

from __future__ import annotations

import asyncio
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

pytestmark = pytest.mark.criu

STEPS = 150
EXPECTED = [f"step {i} {i * i} {i * 3}" for i in range(STEPS)] + ["done"]


def _lines(state_dir: Path) -> list[str]:
    p = state_dir / "jobs" / "pair" / "stdout"
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
