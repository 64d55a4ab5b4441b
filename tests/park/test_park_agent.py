"""The agent runs the park policy: an idle job it protects is parked (as an image here, so
its process ends), the agent does not take that for the job finishing, shows it under
``parked`` in its status and in its metrics, and protects it again once it is unparked."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from park_helpers import JOBS, Sg, ok_json

from sgtest import until
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.jobs import resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park import record
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings

pytestmark = pytest.mark.criu


async def test_agent_parks_an_idle_job_and_protects_it_again(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    ok_json(sg("run", "--name", "nb", "--json", "--", sys.executable, JOBS, "sleeper"))
    first = resolve_job("nb", state_dir=state_dir)
    settings = AgentSettings(
        job=["nb"], store=(tmp_path / "store").as_uri(), api_listen="127.0.0.1:0",
        assignment=tmp_path / "no-assignment.json",
    )  # fmt: skip
    ckpt = CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm")
    park = ParkSettings(to="tmpfs", memory_dir=tmp_path / "shm" / "parked", idle_after=1.5,
                        sample_every=0.3, wake_on_connect=False)  # fmt: skip
    daemon = Agent(
        settings, ckpt, NoticeSettings(cloud="none"), image=ImageSettings(),
        planner=PlannerSettings(), park=park,
    )  # fmt: skip
    task = asyncio.create_task(daemon.run())
    try:
        await until(lambda: record.load(state_dir, "nb") is not None, "the idle job to park", 60.0)
        await until(lambda: daemon.workers["nb"].state == "parked", "the agent to see it", 60.0)
        status = daemon.status()
        assert [p["job"] for p in status["parked"]] == ["nb"]
        assert status["parked"][0]["reason"].startswith("idle for")
        assert b'spotguard_parked_jobs{place="tmpfs"} 1.0' in daemon.metrics.render()
        await asyncio.sleep(1.0)
        assert daemon.workers["nb"].state == "parked"  # not "finished"
        unparked = await asyncio.to_thread(sg, "unpark", "nb", "--json")
        back = ok_json(unparked)
        assert back["pid"] != first.pid
        await until(
            lambda: (
                daemon.workers["nb"].pid == back["pid"]
                and daemon.workers["nb"].state == "protecting"
            ),
            "the agent to protect the unparked job",
            limit=30,
        )
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)
