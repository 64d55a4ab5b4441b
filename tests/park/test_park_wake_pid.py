"""Issue 28.5: after a wake, the agent shows the job's new pid at once (it showed the old one
for up to 5 s: it looked for the job's next incarnation every 5 s).

A real HTTP server job protected by a real agent is parked to tmpfs with wake-on-connect
through the command line (real CRIU); a client connecting wakes it (a new process, a new pid).
From the moment the client has its answer, the agent's status must name the new pid, as
``protecting``, within a second."""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from park_helpers import JOBS, Sg, free_port, ok_json

from sgtest import until
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.jobs import resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings

pytestmark = pytest.mark.criu

#: how long after the woken job answered its first client the agent may still show the old pid
AT_ONCE_S = 1.0


def _get(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/next", timeout=120) as r:
        return str(r.read().decode())


def _shown(daemon: Agent) -> dict[str, Any]:
    return {j["job"]: j for j in daemon.status()["jobs"]}.get("web", {})


async def test_the_agent_shows_a_woken_jobs_new_pid_at_once(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    port = free_port()
    first = ok_json(sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server",
                       str(port)))  # fmt: skip
    await until(lambda: (state_dir / "jobs/web/stdout").exists(), "the server to start", 60.0)
    await until(
        lambda: "listening" in (state_dir / "jobs/web/stdout").read_text(), "the server", 60.0
    )
    settings = AgentSettings(
        job=["web"], store=(tmp_path / "store").as_uri(), api_listen="127.0.0.1:0",
        assignment=tmp_path / "no-assignment.json",
    )  # fmt: skip
    ckpt = CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm")
    park = ParkSettings(memory_dir=tmp_path / "shm" / "parked")
    daemon = Agent(
        settings, ckpt, NoticeSettings(cloud="none"), image=ImageSettings(),
        planner=PlannerSettings(), park=park,
    )  # fmt: skip
    task = asyncio.create_task(daemon.run())
    try:
        await until(lambda: _shown(daemon).get("state") == "protecting", "the agent", 60.0)
        assert _shown(daemon)["pid"] == first["pid"]
        parked = await asyncio.to_thread(
            sg, "park", "web", "--to", "tmpfs", "--wake-on-connect", "--json"
        )
        ok_json(parked)
        await until(lambda: _shown(daemon).get("state") == "parked", "the agent to see it", 60.0)
        await asyncio.sleep(1.0)  # a parked job, looked at for a while
        assert await asyncio.to_thread(_get, port) == "1"  # the client woke the job
        answered = time.monotonic()
        woken = resolve_job("web", state_dir=state_dir).pid
        assert woken != first["pid"]
        await until(
            lambda: (
                _shown(daemon).get("pid") == woken and _shown(daemon).get("state") == "protecting"
            ),
            "the agent to show the woken job",
            limit=30,
        )
        late = time.monotonic() - answered
        assert late < AT_ONCE_S, f"the agent showed the old pid {late:.1f} s after the wake"
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)
