"""The controller killed with ``kill -9`` at every job state, and started again on the same
SQLite state: the job is in the same state after the restart, the state machine carries on
from there, and the job is launched exactly once.

The controller is the real ``spotguard controller`` process with the ``local`` provider; its
"VMs" run a stand-in agent (sg_gated_agent.py) that reports RESTORING, then waits for a gate
file before RESTORED, so a job can be caught in ``restoring``. Events are real HTTP posts
shaped like the agent's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sgtest import free_port as _free_port
from spotguard.contracts import EventKind, make_event
from spotguard.image import ImageSettings, push_dir
from spotguard.providers.base import InstanceRef, Market
from spotguard.providers.local import LocalProvider, LocalSettings

pytestmark = pytest.mark.timeout(120)

TOKEN = "fault-admin-token"
GATED = str(Path(__file__).with_name("sg_gated_agent.py"))
VM1 = {"provider": "local", "instance_id": "vm-first", "region": "local", "zone": "local-1"}


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


@dataclass
class Controller:
    """A ``spotguard controller`` process that the test kills and starts again."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None
    session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    @property
    def vm_log(self) -> Path:
        return self.root / "vms.log"

    def config(self) -> Path:
        cfg = self.root / "controller.toml"
        env = {"STANDIN_GATE": str(self.gate), "STANDIN_LOG": str(self.vm_log)}
        cfg.write_text(
            f"[controller]\ncontroller_token = {json.dumps(TOKEN)}\n\n"  # never on argv (ps)
            "[local]\n"
            f"local_root = {json.dumps(str(self.root / 'local'))}\n"
            f"local_agent_command = {json.dumps([sys.executable, GATED])}\n"
            "local_gpus = false\n"
            f"local_env = {{ {', '.join(f'{k} = {json.dumps(v)}' for k, v in env.items())} }}\n"
        )
        return cfg

    async def start(self) -> None:
        argv = [
            sys.executable, "-m", "spotguard", "--config", str(self.config()), "controller",
            "--listen", f"127.0.0.1:{self.port}", "--provider", "local",
            "--state", str(self.root / "controller.db"),
            "--default-store", (self.root / "store").as_uri(), "--tick-s", "0.05",
            "--notice-grace-s", "0.3", "--capacity-retry-s", "0", "--liveness-s", "0.5",
        ]  # fmt: skip
        self.proc = _spawn(argv, self.root / "controller.log")
        loop = asyncio.get_running_loop()
        end = loop.time() + 30
        assert self.session is not None
        while True:
            try:
                async with self.session.get(self.url + "/healthz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if self.proc.poll() is not None or loop.time() > end:
                log_text = (self.root / "controller.log").read_text()[-3000:]
                raise AssertionError(f"the controller did not start:\n{log_text}")
            await asyncio.sleep(0.1)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    async def event(self, job: str, kind: EventKind, **kw: Any) -> dict[str, Any]:
        ev = make_event(job=job, kind=kind, **kw)
        assert self.session is not None
        async with self.session.post(
            self.url + "/v1/events",
            data=ev.model_dump_json(),
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            out: dict[str, Any] = await r.json()
            assert r.status == 200, out
            return out

    async def view(self, job: str) -> dict[str, Any]:
        assert self.session is not None
        async with self.session.get(
            f"{self.url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            out: dict[str, Any] = await r.json()
            return out

    async def wait_state(self, job: str, *states: str, within: float = 30.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + within
        while True:
            v = await self.view(job)
            if v.get("state") in states:
                return v
            if loop.time() > end:
                raise AssertionError(f"{job} is {v.get('state')} ({v.get('reason')}), not {states}")
            await asyncio.sleep(0.05)

    def launches(self, job: str) -> list[str]:
        """The VMs that started for ``job`` (each VM's stand-in logs itself once)."""
        if not self.vm_log.exists():
            return []
        rows = [ln.split() for ln in self.vm_log.read_text().splitlines()]
        return [vm for name, vm in rows if name == job]


@pytest.fixture
async def controller(tmp_path: Path) -> AsyncIterator[Controller]:
    c = Controller(tmp_path, _free_port())
    c.session = aiohttp.ClientSession()
    await c.start()
    try:
        yield c
    finally:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.terminate()
            c.proc.wait(timeout=10)
        await c.session.close()
        prov = LocalProvider(LocalSettings(local_root=tmp_path / "local", local_gpus=False))
        for vm in sorted((tmp_path / "local" / "vms").glob("vm-*")):
            ref = InstanceRef("local", vm.name, "local", "local-1", "local", Market.ON_DEMAND)
            await prov.terminate(ref)


async def _image(c: Controller, job: str) -> str:
    src = c.root / f"img-{job}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(10_000))
    res = await push_dir(src, (c.root / "store").as_uri(), job, settings=ImageSettings())
    return res.image_url


# state reached before the kill → the states the job may be in right after the restart
STATES = {
    "protected": ("protected",),
    "interrupting": ("interrupting",),
    "checkpointed": ("checkpointed",),
    "launching": ("launching", "restoring"),
    "restoring": ("restoring",),
    "restored": ("protected",),
    "finished": ("finished",),
    "failed": ("failed",),
}
ORDER = ["protected", "interrupting", "checkpointed", "launching"]


async def _drive(c: Controller, job: str, state: str, image: str) -> None:
    """Post the events that bring ``job`` to ``state``."""
    await c.event(job, EventKind.STARTED, instance=VM1, pid=42)
    if state == "finished":
        await c.event(job, EventKind.JOB_FINISHED, instance=VM1)
        return
    if state == "failed":  # stopped, and no image anywhere
        await c.event(job, EventKind.EXITED, instance=VM1)
        await c.wait_state(job, "failed")
        return
    await _advance(c, job, "protected", state, image)


async def _advance(c: Controller, job: str, have: str, want: str, image: str) -> None:
    """From ``have`` to ``want`` along protected → interrupting → checkpointed → launching."""
    deadline = (datetime.now(UTC) + timedelta(seconds=120)).isoformat()
    notice = {"id": f"n-{job}", "cloud": "aws", "kind": "preempt", "deadline": deadline}
    steps = {
        "interrupting": lambda: c.event(job, EventKind.NOTICE, instance=VM1, notice=notice),
        "checkpointed": lambda: c.event(
            job, EventKind.DURABLE, instance=VM1, image_url=image, image_bytes=10_000
        ),
        "launching": lambda: c.event(job, EventKind.EXITED, instance=VM1, image_url=image),
    }
    last = ORDER.index(want) if want in ORDER else len(ORDER) - 1
    for s in ORDER[ORDER.index(have) + 1 : last + 1]:
        r = await steps[s]()
        assert r["state"] == s, r
    if want in ("restoring", "restored"):
        await c.wait_state(job, "restoring")
    if want == "restored":
        c.gate.touch()
        await c.wait_state(job, "protected")


@pytest.mark.parametrize("state", list(STATES))
async def test_controller_killed_at_each_state_resumes_from_its_state_file(
    controller: Controller, state: str
) -> None:
    c = controller
    job = f"ctl-{state}"
    image = "" if state == "failed" else await _image(c, job)  # failed: no image anywhere
    await _drive(c, job, state, image)
    before = await c.view(job)
    c.kill9()
    await c.start()
    after = await c.view(job)
    assert after["state"] in STATES[state], (before["state"], after)
    assert after["restarts"] == before["restarts"] or state == "launching"

    if state in ("finished", "failed"):
        await asyncio.sleep(0.6)  # a few reconcile ticks: nothing may happen
        assert (await c.view(job))["state"] == state
        assert c.launches(job) == []
        return
    if state in ORDER and after["state"] in ORDER:
        await _advance(c, job, after["state"], "launching", image)
    c.gate.touch()
    final = await c.wait_state(job, "protected")
    if state in ("protected", "interrupting", "checkpointed", "launching", "restoring"):
        assert final["instance"]["instance_id"] != "vm-first"
        assert final["restarts"] == 1, final
    await asyncio.sleep(0.6)  # a few reconcile ticks after: no second launch
    launched = c.launches(job)
    assert len(launched) == 1, f"launched {launched} for one relaunch"
    assert (await c.view(job))["instance"]["instance_id"] == launched[0]
