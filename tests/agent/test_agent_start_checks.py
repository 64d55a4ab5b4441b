"""Issue 31, item 14 (smaller faults at the agent's edges), with real processes and servers:

* ``--store s3://BUCKET`` whose bucket does not exist (a real moto server): the agent started
  and found out at the first notice, after the job was stopped; now it refuses to start with
  one line naming the bucket (exit non-zero, no traceback);
* webhook deliveries still pending when the agent stops (a real local webhook that never
  answers): they were dropped silently; now one log line says how many.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import Host
from aiohttp import web

from sgtest import store_servers
from spotguard.notify import Notification, Notifier, NotifyEvent, NotifySettings

_stores = store_servers()
s3_bucket = _stores.s3_bucket  # type: ignore[attr-defined]
fault_proxy = _stores.fault_proxy  # type: ignore[attr-defined]
FaultProxy = _stores.FaultProxy  # type: ignore[attr-defined]

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


def _agent(host: Host, tmp_path: Path, store: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPOTGUARD, "agent", "--store", store, "--cloud", "none", "--state-dir", str(host.state),
         "--api-listen", "127.0.0.1:0", "--assignment", str(tmp_path / "none.json"),
         "--exit-when-done"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_an_s3_store_whose_bucket_does_not_exist_refuses_to_start_the_agent(
    host: Host, tmp_path: Path, aws_env: str
) -> None:
    import boto3

    boto3.client("s3").create_bucket(Bucket="there")
    proc = _agent(host, tmp_path, "s3://no-such-bucket-31/images")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error:"), proc.stderr
    assert "no-such-bucket-31" in last and "does not exist" in last, last


@pytest.fixture
async def silent_hook() -> AsyncIterator[str]:
    """A webhook that takes the request and never answers."""
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/hook", hang)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/hook"
    finally:
        release.set()
        await runner.cleanup()


async def test_webhook_deliveries_pending_at_shutdown_are_logged_with_their_count(
    silent_hook: str, caplog: pytest.LogCaptureFixture
) -> None:
    n = Notifier(NotifySettings(webhook_url=[silent_hook], webhook_timeout_s=60))
    with caplog.at_level(logging.INFO, logger="spotguard.notify"):
        for job in ("a", "b", "c"):
            n.notify(Notification(event=NotifyEvent.DURABLE, job=job, source="agent"))
        await asyncio.sleep(0.2)  # the three POSTs are in flight
        await n.aclose(timeout_s=0.5)
    lines = [r for r in caplog.records if "pending" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].__dict__["pending"] == 3
    assert n.sent == 0


def test_the_store_is_checked_within_the_prefix_of_a_job_the_agent_protects() -> None:
    """The documented deploy scopes a VM's role to its own job's prefix (s3:ListBucket with
    s3:prefix JOB/*): a listing of any other prefix is denied, and the start check made the
    agent refuse to start there. It lists the first job's images (the assignment's first),
    and an unused prefix only when no job is named (discovered jobs)."""
    from spotguard.agent.startup import probe_prefix

    assert probe_prefix(["train-llm", "other"]) == "train-llm/images/"
    assert probe_prefix(["1234", "podman:web", "Bad Name", "eval"]) == "eval/images/"
    assert probe_prefix(["podman:web", "/sys/fs/cgroup/x", "eval"]) == "eval/images/"
    assert probe_prefix([]) == ".spotguard-start-check/"


async def test_a_store_this_vm_may_read_but_not_write_refuses_to_start_the_agent(
    host: Host, tmp_path: Path, s3_bucket: str, fault_proxy: FaultProxy
) -> None:
    """The bucket exists and lists, but this VM's credentials may not write its job's
    images (a real moto server behind a proxy that denies the write): the agent refuses to
    start in one line instead of finding out at the first notice, after the job was
    stopped. The start check writes one small object under the job's prefix."""
    fault_proxy.add("PUT", "/train/.spotguard-start-check", "denied", times=5)
    proc = await asyncio.create_subprocess_exec(
        SPOTGUARD, "agent", "--store", s3_bucket, "--cloud", "none", "--job", "train",
        "--state-dir", str(host.state), "--api-listen", "127.0.0.1:0",
        "--assignment", str(tmp_path / "none.json"), "--exit-when-done",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    stderr = err.decode()
    assert proc.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error: store s3://") and "AccessDenied" in last, stderr
    assert "Traceback" not in stderr
    assert fault_proxy.faults[0].hits >= 1  # the write was tried, and refused
