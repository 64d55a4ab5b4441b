"""Fault cases of the agent's checkpoint path (docs/operations.md, the fault table): real agent
processes killed -9, real CRIU, a real S3 (moto) behind a proxy that stalls, real file stores.

* an agent killed while a staged exit image uploads: the restarted agent pushes it and
  reports it DURABLE; the job is never reported finished;
* an agent restarted after its own exit checkpoint: the dead job is not "finished by itself";
* a staged image left without a record is adopted and pushed; nothing else is deleted;
* one agent per state dir; an unusable store URL refuses to start the agent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import (
    TOKEN,
    EventSink,
    FlakyProxy,
    Host,
    job_argv,
    running_agent,
    settled,
    wait_until,
)

from spotguard import operations
from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree, seal
from spotguard.checkpoint.engine import Mode
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.meta import ImageMeta
from spotguard.errors import ConfigError
from spotguard.facts import GpuInventory, HostFacts
from spotguard.image import ImageSettings, latest_image
from spotguard.notices.settings import NoticeSettings
from spotguard.simulator import MetadataSim

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
#: a job that outlives a slow agent start on a loaded machine (200 s unless stopped)
LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


@pytest.fixture
async def sim(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MetadataSim]:
    async with MetadataSim() as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        yield s


@pytest.fixture
def proxy(aws_env: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[FlakyProxy]:
    import boto3

    boto3.client("s3").create_bucket(Bucket="faults")
    p = FlakyProxy(aws_env).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", p.url)
    try:
        yield p
    finally:
        p.stalled = False
        p.stop()


async def _agent_process(
    host: Host, sink: EventSink, store: str, log: Path, *flags: str
) -> asyncio.subprocess.Process:
    with log.open("ab") as err:
        return await asyncio.create_subprocess_exec(
            SPOTGUARD, "agent", "--job", "train", "--store", store, "--cloud", "aws",
            "--poll-interval", "0.2", "--state-dir", str(host.state), "--shm-dir", str(host.shm),
            "--criu", host.criu, "--api-listen", "127.0.0.1:0", "--stream", "off",
            "--assignment", str(host.state / "none.json"), "--push-retry-max-s", "0.5",
            "--controller-url", sink.url, *flags,
            env={**os.environ, "SPOTGUARD_LOG_FORMAT": "json", "SPOTGUARD_CONTROLLER_TOKEN": TOKEN},
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=err, start_new_session=True,
        )  # fmt: skip


@pytest.mark.criu
async def test_agent_killed_while_a_staged_exit_image_uploads_pushes_it_after_restart(
    host: Host, sink: EventSink, sim: MetadataSim, proxy: FlakyProxy, tmp_path: Path
) -> None:
    store = "s3://faults/spotguard"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    log = tmp_path / "agent.log"
    agent = await _agent_process(host, sink, store, log)
    try:
        await wait_until(lambda: "started" in sink.kinds("train"), 60)
        proxy.stalled = True  # the store hangs from now on: the upload cannot finish
        sim.state.send("aws", "preempt", in_seconds=120)
        await wait_until(lambda: "frozen" in sink.kinds("train"), 60)
        await wait_until(lambda: not proctree.alive(job.pid), 30)  # exit: CRIU stopped it
        kept = operations.kept_images_of(host.checkpoint_settings()).scan()
        assert [k.job for k in kept] == ["train"]  # recorded before the upload started
        assert kept[0].dir.is_dir() and kept[0].mode is Mode.EXIT
        os.killpg(agent.pid, signal.SIGKILL)  # mid-upload
        await agent.wait()

        proxy.stalled = False
        agent = await _agent_process(host, sink, store, log)
        await wait_until(lambda: "exited" in sink.kinds("train"), 90)
        kinds = sink.kinds("train")
        assert "durable" in kinds and "job_finished" not in kinds, kinds
        durable = next(e for e in sink.events if e["kind"] == "durable")
        assert durable["mode"] == "exit"
        assert durable["notice"]["kind"] == "preempt"
        assert await latest_image(store, "train", settings=ImageSettings()) == durable["image_url"]
        assert operations.kept_images_of(host.checkpoint_settings()).scan() == []
        assert not kept[0].dir.exists()
    finally:
        if agent.returncode is None:
            agent.send_signal(signal.SIGTERM)
            await asyncio.wait_for(agent.wait(), 60)
    assert b"Traceback" not in log.read_bytes()
    restored = await operations.restore(
        durable["image_url"], settings=host.checkpoint_settings(), image_settings=ImageSettings()
    )
    try:  # the pushed image is the job: it runs again and goes on writing its output
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 30)
    finally:
        os.kill(restored.pid, signal.SIGKILL)


@pytest.mark.criu
async def test_restarted_agent_after_its_own_exit_does_not_report_the_job_finished(
    host: Host, sink: EventSink, sim: MetadataSim, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    async with running_agent(host, sink, job=["train"], store=store) as agent:
        await wait_until(lambda: "started" in sink.kinds("train"))
        sim.state.send("aws", "preempt", in_seconds=120)
        await wait_until(lambda: "exited" in sink.kinds("train"), 60)
        assert agent.workers["train"].state == "exited"
    assert not proctree.alive(job.pid) and not (job.dir / "exit_status").exists()
    before = len(sink.events)
    async with running_agent(host, sink, cloud="none", job=["train"], store=store) as agent2:
        await wait_until(lambda: "train" in agent2.workers)
        await asyncio.sleep(2.5)  # more than the liveness check's period
        assert agent2.workers["train"].state == "exited"
    later = [e["kind"] for e in sink.events[before:] if e["job"] == "train"]
    assert "job_finished" not in later and "started" not in later, later


async def test_one_agent_per_state_dir(host: Host, tmp_path: Path) -> None:
    async with running_agent(host, None, cloud="none", store=f"file://{tmp_path}/s") as first:
        await wait_until(lambda: first.api is not None)
        second = Agent(
            AgentSettings(api_listen="127.0.0.1:0", assignment=tmp_path / "none.json"),
            host.checkpoint_settings(),
            NoticeSettings(cloud="none"),
            image=ImageSettings(),
        )
        with pytest.raises(ConfigError, match=r"another agent .* already uses the state dir"):
            await second.run()


@pytest.mark.parametrize(
    ("store", "message"),
    [
        ("s3://", "names no bucket"),
        ("ftp://host/x", "unsupported store URL"),
        ("file:///proc/version/images", "cannot create"),
    ],
)
def test_unusable_store_refuses_to_start_the_agent(
    host: Host, tmp_path: Path, store: str, message: str
) -> None:
    proc = subprocess.run(
        [SPOTGUARD, "agent", "--store", store, "--cloud", "none", "--state-dir", str(host.state),
         "--api-listen", "127.0.0.1:0", "--assignment", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error:") and message in last, proc.stderr


async def test_staged_image_without_a_record_is_adopted_and_pushed(
    host: Host, tmp_path: Path
) -> None:
    staged = host.shm / "train-20261123T101500123456Z"
    staged.mkdir(parents=True)
    (staged / "pages-1.img").write_bytes(os.urandom(3 << 20))
    ImageMeta(
        job={"name": "train", "pid": 4242, "dir": str(host.state / "jobs" / "train")},
        mode=Mode.EXIT,
        criu_version="4.2.1",
        host=HostFacts.probe(None),
        gpu=GpuInventory(),
        gpu_processes=[],
        root_ns_pid=1,
        pids=[1],
        staging={"mode": "tmpfs"},
        timeline=[],
    ).write(staged)
    # complete images are sealed by this host (an agent killed after its dump left it);
    # a copy without the seal — planted, or from elsewhere — is never adopted (pushing signs)
    planted = host.shm / "train-20261123T101700123456Z"
    shutil.copytree(staged, planted)
    seal.seal(staged, seal.HostKey.for_state(host.state))
    partial = host.shm / "train-20261123T101600123456Z"  # a dump that never completed
    partial.mkdir()
    (partial / "core-1.img").write_bytes(b"x")
    unrelated = host.shm / "restore-1a2b3c4d"
    unrelated.mkdir()

    images = operations.kept_images_of(host.checkpoint_settings())
    [kept] = images.scan()
    assert kept.adopted and kept.job == "train" and kept.mode is Mode.EXIT and kept.dir == staged
    assert kept.record.exists()
    store = f"file://{tmp_path}/store"
    result = await operations.push_kept(kept, store, images=images, image_settings=ImageSettings())
    assert result.mode == "exit" and result.bytes >= 3 << 20
    assert await latest_image(store, "train", settings=ImageSettings()) == result.image_url
    assert not staged.exists() and not kept.record.exists()
    assert partial.is_dir() and unrelated.is_dir()  # what it cannot account for stays
    assert planted.is_dir()
    assert images.scan() == []


#: the notice of the hanging-store test: short (the test waits it out), long enough to plan
NOTICE_S = 8


@pytest.mark.criu
@pytest.mark.parametrize("policy", ["exit", "resume"])
async def test_a_hanging_store_cannot_hold_the_job_past_the_notices_deadline(
    host: Host, sink: EventSink, sim: MetadataSim, proxy: FlakyProxy, policy: str
) -> None:
    store = "s3://faults/spotguard"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        async with running_agent(
            host, sink, job=["train"], store=store, policy_preempt=policy, push_retry_max_s=0.5
        ) as agent:
            await wait_until(lambda: "started" in sink.kinds("train"))
            proxy.stalled = True
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            sim.state.send("aws", "preempt", in_seconds=NOTICE_S)
            await wait_until(lambda: "checkpoint_failed" in sink.kinds("train"), 40)
            took = loop.time() - t0
            assert took < NOTICE_S + 4, f"the store held the checkpoint {took:.1f} s past it"
            failed = next(e for e in sink.events if e["kind"] == "checkpoint_failed")
            assert "deadline" in failed["error"]["message"], failed["error"]
            if policy == "exit":  # the job is stopped; its image waits here for the store
                assert (failed["step"], failed["kept"]) == ("upload", True)
                assert agent.workers["train"].state == "pushing"
                assert not proctree.alive(job.pid)
            else:  # the job was brought back and runs on
                assert failed["kept"] is False
                assert agent.workers["train"].state == "protecting"
                assert proctree.alive(job.pid)
                assert operations.kept_images_of(host.checkpoint_settings()).scan() == []
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)


async def _spotguard_json(*args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        SPOTGUARD, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    answer: dict[str, Any] = json.loads(out)
    return answer


@pytest.mark.criu
@pytest.mark.parametrize("own_pidns", [True, False], ids=["own-pid-namespace", "host-pids"])
async def test_a_job_restored_by_hand_is_protected_again_and_drain_writes_an_image(
    host: Host, sink: EventSink, tmp_path: Path, own_pidns: bool
) -> None:
    store = f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state, pid_namespace=own_pidns)
    flags = ["--state-dir", str(host.state), "--shm-dir", str(host.shm), "--criu", host.criu]
    restored = 0
    try:
        async with running_agent(host, sink, cloud="none", job=["train"], store=store) as agent:
            await wait_until(lambda: "started" in sink.kinds("train"))
            [first] = (await agent.drain("maintenance", wait=True, deadline_s=60))["results"]
            assert first["state"] == "exited" and not proctree.alive(job.pid)
            # The operator brings the job back by hand, from the image the drain wrote.
            restored = int(
                (await _spotguard_json("restore", first["url"], "--json", *flags))["pid"]
            )
            assert proctree.alive(restored)
            await wait_until(
                lambda: (
                    agent.workers["train"].pid == restored
                    and agent.workers["train"].state == "protecting"
                ),
                30,
            )
            [st] = agent.status()["jobs"]
            assert (st["pid"], st["state"]) == (restored, "protecting")
            assert agent.api is not None
            drained = await _spotguard_json(
                "drain", "--json", "--state-dir", str(host.state), "--api-listen", agent.api.address
            )
            [second] = drained["results"]
            assert second["state"] == "exited" and second["url"] != first["url"]
            assert not proctree.alive(restored)
        started = [e["pid"] for e in sink.events if e["kind"] == "started"]
        assert started == [job.pid, restored], started
        durable = [e["image_url"] for e in sink.events if e["kind"] == "durable"]
        assert durable == [first["url"], second["url"]]
        assert "job_finished" not in sink.kinds("train")
        assert await latest_image(store, "train", settings=ImageSettings()) == second["url"]
    finally:
        for pid in (job.pid, restored):
            if pid and proctree.alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.criu
async def test_a_kept_image_follows_the_configured_store_after_a_restart(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    proxy: FlakyProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("SPOTGUARD_RETRIES", "1")  # fail fast; the agent's pusher retries
    old, new = "s3://faults/spotguard", f"file://{tmp_path}/store"
    job = await start_job(LONG_JOB, "train", state_dir=host.state)
    try:
        proxy.broken = True  # the old store is gone for good
        async with running_agent(host, sink, job=["train"], store=old, push_retry_max_s=0.3):
            await wait_until(lambda: "started" in sink.kinds("train"))
            sim.state.send("aws", "preempt", in_seconds=120)
            await wait_until(lambda: "checkpoint_failed" in sink.kinds("train"))
        [kept] = operations.kept_images_of(host.checkpoint_settings()).scan()
        assert kept.store_url == old and not proctree.alive(job.pid)
        dropped = await settled(lambda: proxy.dropped)  # the first agent's last tries ended
        assert dropped > 0

        caplog.set_level(logging.INFO)
        async with running_agent(
            host, sink, cloud="none", job=["train"], store=new, push_retry_max_s=0.3
        ) as agent:
            await wait_until(lambda: "exited" in sink.kinds("train"))
            assert agent.workers["train"].state == "exited"
        durable = next(e for e in sink.events if e["kind"] == "durable")
        assert durable["image_url"].startswith(f"{new}/train/images/")
        assert await latest_image(new, "train", settings=ImageSettings()) == durable["image_url"]
        assert proxy.dropped == dropped  # the old URL was not tried again
        said = [r for r in caplog.records if r.getMessage().startswith("kept image pushed to")]
        assert [r.__dict__.get("reason") for r in said] == [f"was {old}"]
        assert said[0].__dict__.get("store") == new
        assert operations.kept_images_of(host.checkpoint_settings()).scan() == []
        restored = await operations.restore(
            durable["image_url"],
            settings=host.checkpoint_settings(),
            image_settings=ImageSettings(),
        )
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 30)
        os.kill(restored.pid, signal.SIGKILL)
    finally:
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
