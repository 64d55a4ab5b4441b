"""Issue 17.2: the agent's tasks never die silently. A task that raises is logged with its
name and stops the agent with a non-zero exit (systemd restarts it; ``status`` then says the
agent is not running) instead of running on while protecting nothing."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from pathlib import Path

import pytest

from spotguard.agent import ledger
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.errors import AgentTaskDied
from spotguard.image.settings import ImageSettings
from spotguard.notices.settings import NoticeSettings


async def test_a_dying_task_stops_the_agent_with_an_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    sleeper: subprocess.Popen[bytes],
) -> None:
    job = sleeper

    async def broken(*args: object, **kwargs: object) -> tuple[str, float] | None:
        raise RuntimeError("store client exploded")

    # The fault: the newest-image lookup raises something no layer maps (as a missing
    # SDK did before stores checked their extra).
    monkeypatch.setattr(ledger, "newest_image", broken)
    agent = Agent(
        AgentSettings(
            job=[str(job.pid)], store=(tmp_path / "store").as_uri(), api_listen="127.0.0.1:0"
        ),
        CheckpointSettings(state_dir=tmp_path / "state"),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )
    with (
        caplog.at_level(logging.ERROR, logger="spotguard.agent.daemon"),
        pytest.raises(AgentTaskDied) as info,
    ):
        await asyncio.wait_for(agent.run(), 30)
    assert str(info.value) == f"agent task protect-{job.pid} died: store client exploded"
    assert isinstance(info.value.__cause__, RuntimeError)
    (rec,) = [r for r in caplog.records if r.getMessage().startswith("agent task died")]
    assert rec.__dict__["task"] == f"protect-{job.pid}"
    assert agent.metrics.failures.labels("internal")._value.get() == 1
    assert agent.api is not None and agent.api._runner is None, "the API was shut down"
