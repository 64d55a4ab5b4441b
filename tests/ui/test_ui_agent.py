"""Issue 28.7: the agent's read-only web page (``/ui``) in a real headless Chromium, against a
real agent protecting a real job (periodic checkpoints with real CRIU into a file store) while
another job is parked to tmpfs with wake-on-connect through the command line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_cdp import Browser

from sgtest import free_port, sg_json
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park import record
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings

pytestmark = pytest.mark.criu

TOKEN = "ui-agent-token-51c0"
SLEEPER = "import time\nwhile True: time.sleep(3600)"
SERVER = (
    "import http.server, sys\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.BaseHTTPRequestHandler)"
    ".serve_forever()"
)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The jobs' state dir; whatever the test left running is killed after it."""
    state = tmp_path / "state"
    yield state
    for rec in record.all_records(state):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            os.kill(rec.waker_pid, signal.SIGKILL)
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)


def _sg(config: Path, *args: str) -> dict[str, object]:
    """``spotguard --config CONFIG COMMAND --json ARGS`` (:func:`sgtest.sg_json`)."""
    return sg_json(args[0], "--json", *args[1:], config=config)


def _rows(table: str) -> str:
    return (
        f"[...document.querySelectorAll('#{table} tbody tr')]"
        ".map(r => [...r.cells].map(c => c.innerText.trim()))"
    )


async def test_the_agent_page_shows_its_jobs_images_and_parked_jobs(
    state_dir: Path, tmp_path: Path, criu_bin: str, chromium: str
) -> None:
    port = free_port()
    config = tmp_path / "spotguard.toml"
    config.write_text(
        f'[checkpoint]\nstate_dir = "{state_dir}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\n[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
    )
    _sg(config, "run", "--name", "train", "--", sys.executable, "-c", SLEEPER)
    _sg(config, "run", "--name", "web", "--", sys.executable, "-c", SERVER, str(port))
    await asyncio.sleep(0.5)  # the server listens
    parked = _sg(config, "park", "web", "--to", "tmpfs", "--wake-on-connect")
    assert parked["wake_on_connect"] is True
    train = resolve_job("train", state_dir=state_dir)
    settings = AgentSettings(
        job=["train", "web"], store=(tmp_path / "store").as_uri(), api_listen="127.0.0.1:0",
        api_token=TOKEN, periodic_interval=1.0, assignment=tmp_path / "no-assignment.json",
    )  # fmt: skip
    ckpt = CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=tmp_path / "shm")
    daemon = Agent(
        settings, ckpt, NoticeSettings(cloud="none"), image=ImageSettings(),
        planner=PlannerSettings(), park=ParkSettings(memory_dir=tmp_path / "shm" / "parked"),
    )  # fmt: skip
    task = asyncio.create_task(daemon.run())
    try:
        for _ in range(600):
            w = daemon.workers.get("train")
            if w is not None and w.last_image is not None:
                break
            await asyncio.sleep(0.1)
        assert daemon.workers["train"].last_image is not None, "no periodic image in 60 s"
        assert daemon.api is not None
        async with Browser(chromium, tmp_path / "profile") as page:
            await page.navigate(f"http://{daemon.api.address}/ui")
            await page.wait_for("!document.getElementById('login').hidden", "the token form")
            assert await page.eval(_rows("jobs")) == []
            await page.type_text("#token", TOKEN)
            await page.press_enter()
            await page.wait_for(
                "document.getElementById('status').innerText.startsWith('updated')", "a refresh"
            )
            jobs = {r[0]: r for r in await page.eval(_rows("jobs"))}
            assert set(jobs) == {"train"}  # web is shown under Parked, once
            assert jobs["train"][1] == str(train.pid)
            # a periodic checkpoint runs every second: the page may catch one in progress
            assert jobs["train"][2] in ("protecting", "checkpointing")
            image = daemon.workers["train"].last_image
            assert image is not None
            assert jobs["train"][4].startswith(image.image_url.rsplit("/", 1)[1])
            assert "old" in jobs["train"][4]
            assert int(jobs["train"][5]) >= 1  # checkpoints
            # the next periodic one (due a moment ago while the last one still runs)
            assert jobs["train"][7].startswith("in ") or jobs["train"][7].endswith(" ago")
            rows = await page.eval(_rows("parked"))
            assert [(r[0], r[1], r[5]) for r in rows] == [("web", "parked tmpfs", "yes")]
            summary = await page.eval("document.getElementById('summary').innerText")
            assert (tmp_path / "store").as_uri() in summary
            assert f"agent pid\n{os.getpid()}" in summary or str(os.getpid()) in summary
            assert await page.eval("document.getElementById('events-empty').innerText") == (
                "no notice yet"
            )
            assert all(TOKEN not in r.url for r in page.requests)
            assert page.problems == [], page.problems
            shot = await page.screenshot(tmp_path / "agent-ui.png")
            assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
            out = os.environ.get("SPOTGUARD_UI_SCREENSHOTS")
            if out:
                (Path(out) / "agent-ui.png").write_bytes(shot)
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)
