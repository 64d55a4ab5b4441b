"""Issue 28.7: the controller's read-only web page (``/ui``), driven in a real headless Chromium
against a real controller over HTTP (the local provider; its "VMs" run the stand-in agent).

The page must show every job with its state, the parked job apart, the recent events and a
job's timeline; take the data only with the bearer token (typed in, sent in a header, never in
a URL); show hostile text as text; and run under a Content-Security-Policy the browser
enforces. It fails when the page is broken: every check reads what the browser rendered.

The docs' screenshot (docs/img/controller-ui.png) comes from the same fleet with plain names and
no hostile text, written only with ``SPOTGUARD_UI_SCREENSHOTS=DIR``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ui_cdp import Browser, Page

from spotguard.contracts import EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.image.settings import ImageSettings
from spotguard.providers.base import InstanceRef, Market
from spotguard.providers.local import LocalProvider, LocalSettings
from spotguard.webui import CSP

TOKEN = "ui-admin-token-7f3a"
STANDIN = str(Path(__file__).parents[1] / "controller" / "sg_standin_agent.py")
VM1 = {"provider": "local", "instance_id": "vm-first", "region": "local", "zone": "local-1"}
#: a park reason an agent could send: must be shown as these characters, never run
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
#: the docs' screenshot is written here (``SPOTGUARD_UI_SCREENSHOTS=docs/img``)
SHOTS = os.environ.get("SPOTGUARD_UI_SCREENSHOTS")


class Fleet:
    """A real controller with jobs in several states, reached over HTTP with the token."""

    def __init__(self, url: str, session: aiohttp.ClientSession, tmp: Path) -> None:
        self.url, self.s, self.tmp = url, session, tmp

    async def event(self, job: str, kind: EventKind, **kw: Any) -> dict[str, Any]:
        body = make_event(job=job, kind=kind, **kw).model_dump_json()
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with self.s.post(self.url + "/v1/events", data=body, headers=auth) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
            return out

    async def state(self, job: str) -> str:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with self.s.get(f"{self.url}/v1/jobs/{job}", headers=auth) as r:
            return str((await r.json())["state"])

    def image(self, job: str, stamp: str = "20261122T000000000000Z-abc123") -> str:
        return f"file://{self.tmp}/store/{job}/images/{stamp}"


@asynccontextmanager
async def _fleet(
    tmp_path: Path, train: str = "train", notebook: str = "notebook", batch: str = "batch",
    reason: str = HOSTILE,
) -> AsyncIterator[Fleet]:  # fmt: skip
    """Jobs ``train`` (interrupted, relaunched, restored), ``notebook`` (parked with
    ``reason``) and ``batch`` (finished) on a real controller under ``tmp_path``."""
    prov = LocalProvider(
        LocalSettings(
            local_root=tmp_path / "local",
            local_agent_command=[sys.executable, STANDIN],
            local_gpus=False,
        )
    )
    settings = ControllerSettings(
        listen="127.0.0.1:0", state=tmp_path / "controller.db", provider="local",
        controller_token=TOKEN, default_store=f"file://{tmp_path}/store", tick_s=0.05,
        notice_grace_s=0.3, capacity_retry_s=0.0,
    )  # fmt: skip
    srv = ControllerServer(settings, provider=prov, image=ImageSettings.model_validate({}))
    async with srv, aiohttp.ClientSession() as session:
        f = Fleet(srv.url, session, tmp_path)
        # train: interrupted, relaunched onto a local VM, restored there (a long timeline)
        await f.event(train, EventKind.STARTED, instance=VM1, pid=42)
        await f.event(train, EventKind.EXITED, instance=VM1, image_url=f.image(train))
        # notebook: parked to the store by its agent, with a reason full of markup
        await f.event(notebook, EventKind.STARTED, instance=VM1, pid=43)
        await f.event(
            notebook, EventKind.PARKED, instance=VM1, image_url=f.image(notebook), reason=reason
        )
        # batch: ran to its end
        await f.event(batch, EventKind.STARTED, instance=VM1, pid=44)
        await f.event(batch, EventKind.JOB_FINISHED, instance=VM1)
        for _ in range(1200):
            if await f.state(train) == "protected":
                break
            await asyncio.sleep(0.05)
        assert await f.state(train) == "protected"
        yield f
    for vm in sorted((tmp_path / "local" / "vms").glob("vm-*")):
        ref = InstanceRef("local", vm.name, "local", "local-1", "local", Market.ON_DEMAND)
        await prov.terminate(ref)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    async with _fleet(tmp_path) as f:
        yield f


def _rows(table: str) -> str:
    """JS: the rendered rows of ``table`` as lists of cell texts."""
    return (
        f"[...document.querySelectorAll('#{table} tbody tr')]"
        ".map(r => [...r.cells].map(c => c.innerText.trim()))"
    )


def _shown(selector: str) -> str:
    """JS: whether ``selector`` takes room on the screen (not hidden by any rule)."""
    return (
        f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
        " return getComputedStyle(e).display !== 'none' && e.getClientRects().length > 0; })()"
    )


async def test_the_page_and_its_assets_carry_the_strict_headers(fleet: Fleet) -> None:
    for path in ("/ui", "/ui/", "/ui/static/ui.js", "/ui/static/ui.css", "/ui/static/nope.js"):
        async with fleet.s.get(fleet.url + path) as r:
            assert r.headers["Content-Security-Policy"] == CSP, path
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            assert r.headers["X-Frame-Options"] == "DENY"
            assert r.headers["Referrer-Policy"] == "no-referrer"
            assert r.status == (404 if path.endswith("nope.js") else 200), path
            body = await r.text()
            assert "train" not in body  # no data without the token
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    assert "form-action 'none'" in CSP and "frame-ancestors 'none'" in CSP
    async with fleet.s.get(fleet.url + "/v1/jobs") as r:  # the API still wants its token
        assert r.status == 401


async def _login(page: Page, token: str) -> None:
    await page.wait_for("!document.getElementById('login').hidden", "the token form")
    await page.type_text("#token", token)
    await page.press_enter()


async def test_the_controller_page_shows_jobs_parked_events_and_a_timeline(
    fleet: Fleet, chromium: str, tmp_path: Path
) -> None:
    async with Browser(chromium, tmp_path / "profile") as page:
        await page.navigate(fleet.url + "/ui")
        # no token yet: the form, and not one job
        await page.wait_for("!document.getElementById('login').hidden", "the token form")
        assert await page.eval(_shown("#login")) is True
        assert await page.eval(_rows("jobs")) == []
        assert await page.eval(_shown("#jobs-section")) is False
        # a wrong token is refused in words, nothing is shown
        await _login(page, "not-the-token")
        status = await page.wait_for(
            "document.getElementById('status').innerText.includes('refused') && "
            "document.getElementById('status').innerText",
            "the refusal",
        )
        assert "wrong bearer token" in status
        assert await page.eval(_rows("jobs")) == []
        refused = len(page.problems)  # the browser logs the 401 answer itself

        await _login(page, TOKEN)
        await page.wait_for(
            "document.getElementById('status').innerText.startsWith('updated')", "a refresh"
        )
        assert len(await page.eval(_rows("jobs"))) == 3
        # what is shown is what a person sees: the form gone, the tables laid out
        assert await page.eval(_shown("#login")) is False
        for table in ("#jobs", "#parked", "#events"):
            assert await page.eval(_shown(table)) is True, table
        jobs = {r[0]: r for r in await page.eval(_rows("jobs"))}
        assert set(jobs) == {"train", "notebook", "batch"}
        assert jobs["train"][1] == "protected" and "restored" in jobs["train"][3]
        assert jobs["notebook"][1] == "parked" and jobs["batch"][1] == "finished"
        assert jobs["train"][6].startswith("20261122T000000000000Z-abc123")  # the image and
        assert "old" in jobs["train"][6]  # its age, from the image id's time
        assert "vm-" in jobs["train"][4]  # the instance it runs on now
        # the parked job, apart, with its reason shown as the very characters sent
        parked = await page.eval(_rows("parked"))
        assert [r[0] for r in parked] == ["notebook"]
        assert HOSTILE in parked[0][3]
        assert await page.eval("window.__pwned") is None
        assert await page.eval("document.querySelectorAll('main img, main script').length") == 0
        # recent events of every job, newest first
        events = await page.eval(_rows("events"))
        assert len(events) >= 8
        assert {r[1] for r in events} == {"train", "notebook", "batch"}
        # back to protected once restored: from restoring, or straight from launching where
        # the new VM's report came before its launch was recorded (machine.settle_early_report,
        # met on a loaded machine)
        back = {"restoring → protected", "launching → protected"}
        assert any(r[1] == "train" and r[2] in back for r in events), events
        assert any(r[1] == "notebook" and r[2] == "protected → parked" for r in events)
        # a job's timeline, opened with a real click on its name
        assert await page.eval("document.getElementById('timeline-section').hidden") is True
        await page.click("#jobs button[data-job='train']")
        await page.wait_for(
            "!document.getElementById('timeline-section').hidden", "train's timeline"
        )
        assert await page.eval("document.getElementById('timeline-title').innerText") == (
            "Timeline of train"
        )
        timeline = [r[1] for r in await page.eval(_rows("timeline"))]
        moves = [m for m in timeline if not m.startswith("(")]
        assert moves == [
            "new → protected",
            "protected → launching",
            "launching → restoring",
            "restoring → protected",
        ]
        # the token went only into the Authorization header: never a URL, a cookie or storage
        # other than this tab's session
        assert TOKEN not in await page.eval("location.href")
        assert await page.eval("document.cookie") == ""
        assert await page.eval("localStorage.length") == 0
        assert all(TOKEN not in r.url for r in page.requests)
        api = [r for r in page.requests if "/v1/" in r.url]
        assert api and all(
            r.headers.get("Authorization") in (f"Bearer {TOKEN}", "Bearer not-the-token")
            for r in api
        )
        # the browser enforces the policy: an inline script added to the page does not run
        await page.eval(
            "(() => { const s = document.createElement('script');"
            " s.textContent = 'window.__inline = 1'; document.body.append(s); })()"
        )
        assert await page.eval("window.__inline") is None
        problems = page.problems[refused:]
        violations = [p for p in problems if "Content Security Policy" in p]
        assert violations, problems  # the blocked inline script was reported as a violation
        others = [p for p in problems if p not in violations]
        assert others == [], others  # the page itself ran without an error
        shot = await page.screenshot(tmp_path / "controller-ui.png")
        assert shot.startswith(b"\x89PNG") and len(shot) > 20_000


@pytest.mark.skipif(
    not SHOTS, reason="writes docs/img/controller-ui.png: SPOTGUARD_UI_SCREENSHOTS=DIR"
)
async def test_the_controller_page_screenshot_for_the_docs(chromium: str, docs_root: Path) -> None:
    """The docs' screenshot: plain job names, no test payload, no pytest paths."""
    assert SHOTS is not None
    root = docs_root
    fleet = _fleet(
        root, train="train-llm", notebook="notebook", batch="batch-eval",
        reason="idle for 30 min",
    )  # fmt: skip
    async with fleet as f, Browser(chromium, root / "profile") as page:
        await page.navigate(f.url + "/ui")
        await _login(page, TOKEN)
        await page.wait_for(
            "document.getElementById('status').innerText.startsWith('updated')", "a refresh"
        )
        await page.click("#jobs button[data-job='train-llm']")
        await page.wait_for("!document.getElementById('timeline-section').hidden", "the timeline")
        shot = await page.screenshot(root / "controller-ui.png")
        assert shot.startswith(b"\x89PNG") and len(shot) > 20_000
        (Path(SHOTS) / "controller-ui.png").write_bytes(shot)
