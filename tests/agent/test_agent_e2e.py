"""The agent end to end, in this event loop: the real metadata-sim injects notices, real jobs
are frozen by real CRIU, images land in a real store (moto S3 or file://), events reach a real
HTTP endpoint, and restored jobs print exactly what an uninterrupted run prints. Images are
streamed (the default); the GCP test takes the staging path (``stream = off``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agent_helpers import (
    TOKEN,
    EventSink,
    Host,
    job_argv,
    job_output_when_done,
    proc_state,
    running_agent,
    wait_until,
)

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job
from spotguard.contracts import Assignment
from spotguard.image import ImageReader, ImageSettings, latest_image, verify_image
from spotguard.simulator import MetadataSim
from spotguard.statedir import StateDir

pytestmark = pytest.mark.criu


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        yield s


#: the sample job for 10 s (the helpers' 3.5 s one had ended before a loaded clean-clone
#: run's agent froze it: "freeze failed; job resumed"); its output does not depend on the pace
E2E_ARGS = ("--steps", "200", "--step-seconds", "0.05", "--mb", "4", "--seed", "7", "--gpu", "no")


@pytest.fixture(scope="module")
def reference_output() -> str:
    """What :data:`E2E_ARGS`' job prints when nothing interrupts it (computed at full speed)."""
    fast = [*E2E_ARGS[:2], "--step-seconds", "0", *E2E_ARGS[4:]]
    return subprocess.run(job_argv(*fast), capture_output=True, text=True, check=True).stdout


@pytest.fixture
async def job(host: Host) -> AsyncIterator[JobInfo]:
    info = await start_job(job_argv(*E2E_ARGS), "train", state_dir=host.state)
    yield info
    for pid in (info.pid, *_restored_pids(host)):
        if proctree.alive(pid):
            os.kill(pid, signal.SIGKILL)


def _restored_pids(host: Host) -> list[int]:
    try:
        return [json.loads((StateDir(host.state).job("train") / "job.json").read_text())["pid"]]
    except (OSError, ValueError, KeyError):
        return []


def event(sink: EventSink, kind: str) -> dict[str, Any]:
    return next(e for e in sink.events if e["kind"] == kind)


def in_order(kinds: list[str], *expected: str) -> bool:
    pos = [kinds.index(k) for k in expected]
    return pos == sorted(pos)


async def test_aws_spot_terminate_image_in_s3_restores_identically(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    aws_env: str,
    job: JobInfo,
    reference_output: str,
) -> None:
    import boto3

    boto3.client("s3").create_bucket(Bucket="ckpt")
    store = "s3://ckpt/spotguard"
    async with running_agent(host, sink, job=["train"], store=store):
        await wait_until(lambda: "started" in sink.kinds("train"))
        sim.state.send("aws", "preempt", in_seconds=120)
        await wait_until(lambda: "exited" in sink.kinds("train"))
    kinds = sink.kinds("train")
    assert in_order(kinds, "started", "notice", "frozen", "durable", "exited"), kinds
    durable = event(sink, "durable")
    assert durable["image_url"].startswith(f"{store}/train/images/")
    assert durable["image_bytes"] > 0
    assert durable["instance"]["provider"] == "aws"
    assert durable["instance"]["instance_type"] == "g5.xlarge"
    assert durable["notice"]["kind"] == "preempt"
    assert not proctree.alive(job.pid)
    assert await latest_image(store, "train", settings=ImageSettings()) == durable["image_url"]
    # Streamed by default, and the manifest carries what a staged one does.
    async with ImageReader(durable["image_url"], settings=ImageSettings()) as reader:
        meta = reader.manifest.meta
    assert "stream" in meta and meta["mode"] == "exit"
    assert meta["instance"]["instance_type"] == "g5.xlarge"
    assert meta["notice"]["kind"] == "preempt" and meta["reason"]
    assert {"gpu", "host", "criu_version", "staging", "frozen_at"} <= set(meta)

    restored = await operations.restore(
        durable["image_url"], settings=host.checkpoint_settings(), image_settings=ImageSettings()
    )
    assert restored.job.name == "train"
    assert await job_output_when_done(job.dir) == reference_output


async def test_gcp_preemption_then_assignment_restore_on_a_new_agent(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    job: JobInfo,
    reference_output: str,
    tmp_path: Path,
) -> None:
    store = f"file://{tmp_path}/store"
    staged = {"stream": "off"}  # the staging path, end to end
    async with running_agent(
        host, sink, cloud="gcp", job=["train"], store=store, checkpoint=staged
    ):
        await wait_until(lambda: "started" in sink.kinds("train"))
        sim.state.send("gcp", "preempt")  # GCP gives 30 s
        await wait_until(lambda: "exited" in sink.kinds("train"))
    notice = event(sink, "notice")["notice"]
    assert (notice["cloud"], notice["kind"]) == ("gcp", "preempt")
    image_url = event(sink, "durable")["image_url"]
    async with ImageReader(image_url, settings=ImageSettings()) as reader:
        meta = reader.manifest.meta
    assert "stream" not in meta and meta["notice"]["cloud"] == "gcp" and meta["instance"]

    # The controller's new VM: an assignment file, an agent that restores and then protects.
    assignment = tmp_path / "assignment.json"
    assignment.write_text(
        Assignment(
            job="train", image_url=image_url, store=store, controller_url=sink.url,
            controller_token=TOKEN,
        ).user_data()
    )  # fmt: skip
    sink.events.clear()
    sim.state.reset()  # the new VM has not been preempted
    async with running_agent(
        host, None, cloud="gcp", store=store, assignment=assignment, exit_when_done=True
    ) as agent:
        await wait_until(lambda: "job_finished" in sink.kinds("train"))
        assert agent.workers["train"].state == "finished"
    assert in_order(sink.kinds("train"), "restoring", "restored", "started", "job_finished")
    assert await job_output_when_done(job.dir) == reference_output


async def test_azure_preempt_is_acknowledged_after_the_image_is_durable(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    job: JobInfo,
    reference_output: str,
    tmp_path: Path,
) -> None:
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, cloud="azure", job=["train"], store=store):
        await wait_until(lambda: "started" in sink.kinds("train"))
        sent = sim.state.send("azure", "preempt")
        await wait_until(lambda: "exited" in sink.kinds("train"))
        await wait_until(lambda: sim.state.acks == [sent.id])
    assert event(sink, "notice")["notice"]["id"] == sent.id
    await operations.restore(
        event(sink, "durable")["image_url"],
        settings=host.checkpoint_settings(),
        image_settings=ImageSettings(),
    )
    assert await job_output_when_done(job.dir) == reference_output


async def test_rebalance_checkpoints_and_the_job_keeps_running(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    job: JobInfo,
    reference_output: str,
    tmp_path: Path,
) -> None:
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, job=["train"], store=store) as agent:
        await wait_until(lambda: "started" in sink.kinds("train"))
        sim.state.send("aws", "rebalance")
        await wait_until(lambda: "durable" in sink.kinds("train"))
        durable = event(sink, "durable")
        assert durable["mode"] == "resume"
        assert durable["pause_seconds"] > 0
        assert proctree.alive(job.pid) and agent.workers["train"].state == "protecting"
        assert await job_output_when_done(job.dir) == reference_output
        await wait_until(lambda: "job_finished" in sink.kinds("train"))
    assert "exited" not in sink.kinds("train")
    assert (await verify_image(durable["image_url"], settings=ImageSettings())).ok


async def test_cancelled_scheduled_event_does_nothing(
    host: Host, sink: EventSink, sim: MetadataSim, job: JobInfo, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, job=["train"], store=store) as agent:
        await wait_until(lambda: "started" in sink.kinds("train"))
        # NotBefore in 10 min; the checkpoint would start 5 min before it.
        sent = sim.state.send("aws", "maintenance", action="instance-stop", in_seconds=600)
        worker = agent.workers["train"]
        await wait_until(lambda: sent.id in worker.pending)
        sim.state.cancel(sent.id)
        await wait_until(lambda: not worker.pending)
        assert worker.state == "protecting"
        assert proc_state(job.pid) in ("R", "S")
    kinds = sink.kinds("train")
    assert kinds.count("notice") == 2  # the event, then its withdrawal
    assert [e["notice"]["cancelled"] for e in sink.events if e["kind"] == "notice"] == [
        False,
        True,
    ]
    assert not {"frozen", "durable", "exited", "checkpoint_failed"} & set(kinds)
    assert await latest_image(store, "train", settings=ImageSettings()) is None


async def test_manual_drain_through_the_local_api_and_cli(
    host: Host, sink: EventSink, sim: MetadataSim, job: JobInfo, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, job=["train"], store=store) as agent:
        await wait_until(lambda: "started" in sink.kinds("train"))
        assert agent.api is not None
        base = f"http://{agent.api.address}"
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{base}/status") as r:
                assert r.status == 401  # no token
            async with http.get(f"{base}/healthz") as r:
                assert (await r.json()) == {"ok": True}
        cli = [str(Path(sys.executable).parent / "spotguard")]
        flags = ["--state-dir", str(host.state), "--api-listen", agent.api.address]
        proc = await asyncio.create_subprocess_exec(
            *cli, "drain", "--reason", "node upgrade", "--json", *flags,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        answer = json.loads(out)
        [result] = answer["results"]
        assert result["state"] == "exited" and result["url"].startswith(f"{store}/train/images/")
        proc = await asyncio.create_subprocess_exec(
            *cli, "status", "--json", *flags,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        status = json.loads(out)
        [st] = status["jobs"]
        assert st["state"] == "exited" and st["last_image"]["url"] == result["url"]
        async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
            metrics = await r.text()
        assert 'spotguard_notices_total{cloud="manual",kind="drain"} 1.0' in metrics
        assert 'spotguard_checkpoints_total{mode="exit",spotguard_job="train"} 1.0' in metrics
        assert 'spotguard_last_image_age_seconds{spotguard_job="train"}' in metrics
    kinds = sink.kinds("train")
    assert in_order(kinds, "notice", "frozen", "durable", "exited", "ready_to_relaunch"), kinds
    assert not proctree.alive(job.pid)


async def test_failed_checkpoint_is_reported_and_protection_continues(
    host: Host, sink: EventSink, sim: MetadataSim, job: JobInfo, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    async with running_agent(host, sink, job=["train"], store=f"file://{store}") as agent:
        await wait_until(lambda: "started" in sink.kinds("train"))
        # The store was usable at start (checked then); now a file stands where it was.
        store.rmdir()
        store.write_text("a file where the store should be")
        sim.state.send("aws", "rebalance")
        await wait_until(lambda: "checkpoint_failed" in sink.kinds("train"))
        assert agent.workers["train"].state == "protecting"
        assert proc_state(job.pid) in ("R", "S")  # thawed, running
        failed = event(sink, "checkpoint_failed")
        assert failed["step"] == "upload" and failed["error"]
        assert b'spotguard_failures_total{step="upload"} 1.0' in agent.metrics.render()


async def test_periodic_checkpoints_dedup_and_report_the_pause(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPOTGUARD_CHUNK_SIZE", str(256 << 10))  # small job: small chunks
    store = f"file://{tmp_path}/store"
    # a job that outlives two checkpoints on a loaded host (the shared one ends in 3.5 s)
    long = job_argv("--steps", "600", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")
    job = await start_job(long, "train", state_dir=host.state)
    try:
        async with running_agent(host, sink, job=["train"], store=store, periodic_interval=0.5):
            await wait_until(lambda: sink.kinds("train").count("durable") >= 2)
        images = [e for e in sink.events if e["kind"] == "durable"]
        assert all(e["mode"] == "resume" for e in images)
        assert all(e["pause_seconds"] > 0 for e in images)
        assert images[1]["skipped_bytes"] > 0  # dedup against the first image
        assert images[1]["stored_bytes"] < images[0]["stored_bytes"]
        assert proctree.alive(job.pid)  # leave-running: it runs on
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)


async def test_controller_asking_for_a_drain_gets_one(
    host: Host, sink: EventSink, sim: MetadataSim, job: JobInfo, tmp_path: Path
) -> None:
    sink.answer = {
        "job": "train", "state": "protected", "action": "drain",
        "reason": "migration to us-west-2",
    }  # fmt: skip
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, job=["train"], store=store):
        await wait_until(lambda: "ready_to_relaunch" in sink.kinds("train"))
    notice = event(sink, "frozen")["notice"]
    assert (notice["cloud"], notice["kind"]) == ("manual", "drain")
    assert sink.kinds("train").count("durable") == 1  # one drain, however often it is asked
    assert not proctree.alive(job.pid)


async def test_a_notice_that_came_before_the_job_was_protected_still_applies(
    host: Host, sink: EventSink, sim: MetadataSim, tmp_path: Path
) -> None:
    """A notice the agent saw before it protected the job (an agent restarted with a notice
    posted, or a job that started after the notice) is applied once the job is protected,
    while the notice is still live — not dropped because no job was there yet."""
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, job=["train"], store=store) as agent:
        sim.state.send("aws", "rebalance")
        await wait_until(lambda: any(n["kind"] == "rebalance" for n in agent.notices_seen))
        assert "train" not in agent.workers  # no job protected when the notice came
        long_job = job_argv("--steps", "600", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")
        info = await start_job(long_job, "train", state_dir=host.state)
        try:
            await wait_until(lambda: "durable" in sink.kinds("train"), 60)
            durable = event(sink, "durable")
            assert durable["mode"] == "resume" and durable["notice"]["kind"] == "rebalance"
            assert proctree.alive(info.pid)
        finally:
            if proctree.alive(info.pid):
                os.kill(info.pid, signal.SIGKILL)
