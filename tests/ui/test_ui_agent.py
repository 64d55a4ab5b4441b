"""Issue 28.7: the agent's read-only web page (``/ui``) in a real headless Chromium, against a
real agent protecting a real job (periodic checkpoints with real CRIU into a file store) while
another job is parked to tmpfs with wake-on-connect through the command line (with a reason
full of markup, which the page must show as text), then unparked.

The docs' screenshot (docs/img/agent-ui.png) comes from the same scenario with plain names and
no hostile text, written only with ``SPOTGUARD_UI_SCREENSHOTS=DIR``."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from ui_cdp import Browser, Page

from sgtest import free_port, sg_json
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, list_jobs, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.park import record
from spotguard.park.settings import ParkSettings
from spotguard.planner import PlannerSettings

pytestmark = pytest.mark.criu

TOKEN = "ui-agent-token-51c0"
#: a park reason: must be shown as these characters, never run
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
#: the docs' screenshot is written here (``SPOTGUARD_UI_SCREENSHOTS=docs/img``)
SHOTS = os.environ.get("SPOTGUARD_UI_SCREENSHOTS")
SLEEPER = "import time\nwhile True: time.sleep(3600)"
SERVER = (
    "import http.server, sys\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.BaseHTTPRequestHandler)"
    ".serve_forever()"
)


def _kill_left(state: Path) -> None:
    """Kill whatever a test left running under ``state``."""
    for rec in record.all_records(state):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            os.kill(rec.waker_pid, signal.SIGKILL)
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The jobs' state dir; whatever the test left running is killed after it."""
    state = tmp_path / "state"
    yield state
    _kill_left(state)


def _sg(config: Path, *args: str) -> dict[str, object]:
    """``spotguard --config CONFIG COMMAND --json ARGS`` (:func:`sgtest.sg_json`)."""
    return sg_json(args[0], "--json", *args[1:], config=config)


def _rows(table: str) -> str:
    return (
        f"[...document.querySelectorAll('#{table} tbody tr')]"
        ".map(r => [...r.cells].map(c => c.innerText.trim()))"
    )


@asynccontextmanager
async def _agent(
    root: Path, criu_bin: str, *, train: str, web: str, reason: str
) -> AsyncIterator[tuple[Agent, JobInfo, Path]]:
    """Under ``root``: job ``train`` protected by a real agent (a periodic checkpoint every
    second, one already durable) and job ``web`` (a listening server) parked to tmpfs with
    wake-on-connect and ``reason`` before the agent started. Yields the agent, ``train`` and
    the config file."""
    state_dir, shm = root / "state", root / "shm"
    port = free_port()
    config = root / "spotguard.toml"
    config.write_text(
        f'[checkpoint]\nstate_dir = "{state_dir}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{shm}"\n[park]\nmemory_dir = "{shm / "parked"}"\n'
    )
    _sg(config, "run", "--name", train, "--", sys.executable, "-c", SLEEPER)
    _sg(config, "run", "--name", web, "--", sys.executable, "-c", SERVER, str(port))
    await asyncio.sleep(0.5)  # the server listens
    parked = _sg(config, "park", web, "--to", "tmpfs", "--wake-on-connect", "--reason", reason)
    assert parked["wake_on_connect"] is True
    info = resolve_job(train, state_dir=state_dir)
    settings = AgentSettings(
        job=[train, web], store=(root / "store").as_uri(), api_listen="127.0.0.1:0",
        api_token=TOKEN, periodic_interval=1.0, assignment=root / "no-assignment.json",
    )  # fmt: skip
    ckpt = CheckpointSettings(state_dir=state_dir, criu=criu_bin, shm_dir=shm)
    daemon = Agent(
        settings, ckpt, NoticeSettings(cloud="none"), image=ImageSettings(),
        planner=PlannerSettings(), park=ParkSettings(memory_dir=shm / "parked"),
    )  # fmt: skip
    task = asyncio.create_task(daemon.run())
    try:
        for _ in range(600):
            w = daemon.workers.get(train)
            if w is not None and w.last_image is not None:
                break
            await asyncio.sleep(0.1)
        assert daemon.workers[train].last_image is not None, "no periodic image in 60 s"
        assert daemon.api is not None
        yield daemon, info, config
    finally:
        daemon.request_stop()
        await asyncio.wait_for(task, 60)


async def _open(page: Page, daemon: Agent) -> None:
    """Open the agent's page, type the token in and wait for the data."""
    assert daemon.api is not None
    await page.navigate(f"http://{daemon.api.address}/ui")
    await page.wait_for("!document.getElementById('login').hidden", "the token form")
    assert await page.eval(_rows("jobs")) == []
    await page.type_text("#token", TOKEN)
    await page.press_enter()
    await page.wait_for(
        "document.getElementById('status').innerText.startsWith('updated')", "a refresh"
    )


async def test_the_agent_page_shows_its_jobs_images_parked_jobs_and_events(
    state_dir: Path, tmp_path: Path, criu_bin: str, chromium: str
) -> None:
    scenario = _agent(tmp_path, criu_bin, train="train", web="web", reason=HOSTILE)
    async with scenario as (daemon, train, config), Browser(chromium, tmp_path / "profile") as page:
        await _open(page, daemon)
        jobs = {r[0]: r for r in await page.eval(_rows("jobs"))}
        assert set(jobs) == {"train"}  # web is shown under Parked, once
        assert jobs["train"][1] == str(train.pid)
        # a periodic checkpoint runs every second: the page may catch one in progress
        assert jobs["train"][2] in ("protecting", "checkpointing")
        image = daemon.workers["train"].last_image
        assert image is not None
        # the newest image when the page was drawn: this one, or an earlier one where a
        # periodic checkpoint finished since (image ids sort by time)
        shown = jobs["train"][4].split()[0]
        assert re.fullmatch(r"\d{8}T\d{12}Z-[0-9a-f]{6}", shown), jobs["train"]
        assert shown <= image.image_url.rsplit("/", 1)[1], (shown, image.image_url)
        assert "old" in jobs["train"][4]
        assert int(jobs["train"][5]) >= 1  # checkpoints
        # the next periodic one (due a moment ago while the last one still runs)
        assert jobs["train"][7].startswith("in ") or jobs["train"][7].endswith(" ago")
        rows = await page.eval(_rows("parked"))
        assert [(r[0], r[1], r[5]) for r in rows] == [("web", "parked tmpfs", "yes")]
        assert rows[0][6] == HOSTILE  # the reason, as the very characters given
        summary = await page.eval("document.getElementById('summary').innerText")
        assert (tmp_path / "store").as_uri() in summary
        assert f"agent pid\n{os.getpid()}" in summary or str(os.getpid()) in summary
        # recent events, newest first: train's checkpoints after web's park (done before the
        # agent started), each with its time, job and words; the markup shown as text
        events = await page.eval(_rows("events"))
        kinds = [(r[1], r[2]) for r in events]
        assert ("train", "durable") in kinds and ("train", "frozen") in kinds, events
        assert ("web", "parked") in kinds, events
        assert kinds.index(("train", "durable")) < kinds.index(("web", "parked"))
        durable = events[kinds.index(("train", "durable"))]
        assert durable[0].endswith(" ago") and "durable" in durable[3]
        assert [r[3] for r in events if r[2] == "parked"] == [
            f"parked to tmpfs, {rows[0][4]}; wakes on connect ({HOSTILE})"
        ]
        assert await page.eval("window.__pwned") is None
        assert await page.eval("document.querySelectorAll('main img, main script').length") == 0
        # unparked by hand: the page tells it, and the job is protected again
        _sg(config, "unpark", "web")
        await page.navigate(f"http://{daemon.api.address}/ui")  # the token stays in the tab
        await page.wait_for(
            "[...document.querySelectorAll('#events tbody tr')].some(r => "
            "r.dataset.kind === 'unparked' && r.cells[1].innerText === 'web')",
            "web's unpark",
        )
        events = await page.eval(_rows("events"))
        assert events[[(r[1], r[2]) for r in events].index(("web", "unparked"))][3] == (
            "unparked from tmpfs"
        )
        assert all(TOKEN not in r.url for r in page.requests)
        assert page.problems == [], page.problems
        shot = await page.screenshot(tmp_path / "agent-ui.png")
        assert shot.startswith(b"\x89PNG") and len(shot) > 10_000


@pytest.mark.skipif(not SHOTS, reason="writes docs/img/agent-ui.png: SPOTGUARD_UI_SCREENSHOTS=DIR")
async def test_the_agent_page_screenshot_for_the_docs(
    criu_bin: str, chromium: str, docs_root: Path
) -> None:
    """The docs' screenshot: plain job names, no test payload, no pytest paths."""
    assert SHOTS is not None
    root = docs_root
    try:
        scenario = _agent(
            root, criu_bin, train="train-llm", web="notebook", reason="idle for 30 min"
        )
        async with scenario as (daemon, _, _), Browser(chromium, root / "profile") as page:
            await _open(page, daemon)
            await page.wait_for(
                "document.querySelectorAll('#events tbody tr').length >= 3", "the events"
            )
            shot = await page.screenshot(root / "agent-ui.png")
            assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
            (Path(SHOTS) / "agent-ui.png").write_bytes(shot)
    finally:
        _kill_left(root / "state")
