"""A spot notice that arrives while a leave-running checkpoint is still storing its image.

On AWS a rebalance recommendation (a leave-running checkpoint by default) often comes shortly
before the interruption notice. The job runs again as soon as the rebalance image is in host
memory; its upload may take long (a large job, a slow store). The notice's exit image must not
wait behind that upload when the exit alone is predicted to fit the deadline: the agent gives
the running checkpoint up (no manifest; the job is brought back as from any cancelled freeze)
and takes the exit image at once. The agent is a real process, the store S3 on moto behind
a proxy that holds every chunk upload of the rebalance image unanswered.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv, wait_until
from test_agent_kill import FaultProxy, start_agent

from spotguard.checkpoint.jobs import start_job
from spotguard.image import ImageSettings, verify_image
from spotguard.image.catalog import list_images
from spotguard.simulator import MetadataSim

pytestmark = pytest.mark.criu

JOB = ("--steps", "2000", "--step-seconds", "0.03", "--mb", "64", "--seed", "7", "--gpu", "no")


async def test_an_interruption_notice_does_not_wait_for_a_rebalance_image_still_uploading(
    host: Host,
    sink: EventSink,
    sim: MetadataSim,
    tmp_path: Path,
    fault_proxy: FaultProxy,
    s3_bucket: str,
) -> None:
    job = await start_job(job_argv(*JOB), "train", state_dir=host.state)
    store = f"{s3_bucket}/images"
    agent = await start_agent(host, sim, sink, store, tmp_path / "agent.log", hold=True)
    try:
        await wait_until(lambda: "durable" in sink.kinds("train"), 60)  # the first image
        stuck = fault_proxy.add("PUT", "/chunks/", "hang", times=1_000_000)
        sim.state.send("aws", "rebalance")
        await wait_until(lambda: stuck.hits >= 1, 60)  # the rebalance image's upload hangs
        size = (job.dir / "stdout").stat().st_size
        await wait_until(lambda: (job.dir / "stdout").stat().st_size > size, 30)  # job runs
        stuck.times = 0  # later uploads go through; the hung ones stay hung
        sim.state.send("aws", "preempt", in_seconds=120)
        # the exit image is durable and the job stopped; the rebalance image never is (its
        # hung uploads would time out and be retried after 30 s: the old code waited for them)
        await wait_until(lambda: "exited" in sink.kinds("train"), 60)
        durable = [e for e in sink.events if e["kind"] == "durable"]
        assert len(durable) == 2, durable  # the first image and the exit's, no rebalance one
        exit_image = durable[-1]["image_url"]
        assert durable[-1]["notice"]["kind"] == "preempt"
        assert any("gave way" in line for line in (tmp_path / "agent.log").read_text().splitlines())
    finally:
        fault_proxy.released.set()
        agent.terminate()
        await agent.wait()
    images = await list_images(store, "train", settings=ImageSettings())
    assert exit_image in {i.url for i in images if i.complete}
    assert (await verify_image(exit_image, settings=ImageSettings())).ok
