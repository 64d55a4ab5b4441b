"""Agent latency: notice → frozen and notice → durable, through the real agent daemon.

Each run starts a fresh job with ``spotguard run``'s machinery, an :class:`Agent` in this
process watching the metadata emulator (AWS polled every 1 s, or the GCP long-poll), injects a
preemption and times, from the injection:

* **frozen** — the job's state is in host memory (CRIU's dump ended; staged in tmpfs);
* **durable** — the image's manifest is in the store.

``python -m bench.agent_latency [--runs 5] [--sizes 512,2048,4096] [--s3-mb 512]``

Latency runs use a 4 MiB sample job (injections at random phases of the poll). Size runs hold
incompressible (random) memory, the worst case for compression and upload, and go to a
``file://`` store on the local disk; ``--s3-mb`` adds one run to a moto S3 server.
Needs root and CRIU (scripts/install-criu).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings
from spotguard.planner import PlannerSettings
from spotguard.simulator import MetadataSim

SAMPLE = [
    sys.executable,
    "-m",
    "spotguard.demo.job",
    "--steps",
    "100000",
    "--mb",
    "4",
    "--gpu",
    "no",
]


def holder(mb: int) -> list[str]:
    """A job holding ``mb`` MiB of random bytes and ticking once a second."""
    code = (
        "import os,time\n"
        f"b=[os.urandom(64<<20) for _ in range({max(1, mb // 64)})]\n"
        "print('ready',flush=True)\n"
        "while True:\n time.sleep(1); print(len(b),flush=True)\n"
    )
    return [sys.executable, "-c", code]


async def one_run(
    root: Path, sim: MetadataSim, cloud: str, argv: list[str], store: str, ready_s: float
) -> dict[str, Any]:
    state = root / "state"
    shm = Path("/dev/shm") / f"sg-bench-{os.getpid()}"
    ckpt = CheckpointSettings(state_dir=state, shm_dir=shm)
    job = await start_job(argv, "bench", state_dir=state)
    stdout = job.dir / "stdout"
    deadline = time.monotonic() + ready_s
    while not stdout.exists() or stdout.stat().st_size == 0:  # the job holds its memory
        if time.monotonic() > deadline:
            raise RuntimeError("job did not get ready")
        await asyncio.sleep(0.05)
    settings = AgentSettings(
        job=["bench"], store=store, api_listen="127.0.0.1:0", assignment=root / "none.json"
    )
    notices = NoticeSettings(cloud=cloud, poll_interval=1.0)
    agent = Agent(settings, ckpt, notices, image=ImageSettings(), planner=PlannerSettings())
    task = asyncio.create_task(agent.run())
    try:
        while "bench" not in agent.workers:  # noqa: ASYNC110 - polling the daemon from outside
            await asyncio.sleep(0.01)
        worker = agent.workers["bench"]
        await asyncio.sleep(random.uniform(0.2, 1.2))  # a random phase of the AWS poll
        injected = time.time()
        sim.state.send(cloud, "preempt")
        while worker.state != "exited":
            if worker.failures:
                raise RuntimeError("checkpoint failed (see log)")
            await asyncio.sleep(0.01)
        if worker.last_image is None:
            raise RuntimeError("no image (see log)")
        frozen, durable = worker.last_image.frozen_at, worker.last_image.durable_at
        return {
            "frozen_s": frozen - injected,
            "durable_s": durable - injected,
            "freeze_s": round(worker.last_image.freeze_seconds, 3),
            "bytes": worker.last_image.bytes,
            "stored": worker.last_image.stored_bytes,
        }
    finally:
        agent.request_stop()
        await task
        sim.state.reset()
        if proctree.alive(job.pid):
            os.kill(job.pid, signal.SIGKILL)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def fmt(values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    return " | ".join(f"{x:.0f}" for x in (ms[0], statistics.median(ms), ms[-1]))


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--sizes", default="512,2048,4096", help="MiB per size run ('' = none)")
    p.add_argument("--s3-mb", type=int, default=512, help="MiB for the moto S3 run (0 = none)")
    args = p.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix="sg-bench-"))
    store = f"file://{root}/store"
    print(f"# {platform.node()} {os.cpu_count()} cores, {platform.platform()}, {datetime.now():%F}")
    async with MetadataSim() as sim:
        os.environ.update(sim.env())
        print("\n| notice | runs | frozen min ms | median | max | durable median ms | target |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        clouds = (("aws", "≤ 1200 ms frozen"), ("gcp", "≤ 200 ms frozen")) if args.runs else ()
        for cloud, target in clouds:
            res = [await one_run(root, sim, cloud, SAMPLE, store, 30) for _ in range(args.runs)]
            durable = statistics.median(r["durable_s"] for r in res) * 1000
            name = "AWS spot (poll 1 s)" if cloud == "aws" else "GCP preempt (long-poll)"
            print(f"| {name} | {len(res)} | {fmt([r['frozen_s'] for r in res])} "
                  f"| {durable:.0f} | {target} |")  # fmt: skip
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
        runs: list[tuple[str, int, str]] = [(store, mb, "file://") for mb in sizes]
        moto = None
        if args.s3_mb:
            from moto.server import ThreadedMotoServer

            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
            moto.start()
            host, port = moto.get_host_and_port()
            os.environ.update(
                AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="x",
                AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1",
            )  # fmt: skip
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench")
            runs.append(("s3://bench/images", args.s3_mb, "moto S3"))
        print(
            "\n| job memory | store | notice→frozen s | notice→durable s | image MiB | stored MiB |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
        for url, mb, label in runs:
            r = await one_run(root, sim, "gcp", holder(mb), url, 120)
            print(f"| {mb} MiB | {label} | {r['frozen_s']:.2f} | {r['durable_s']:.2f} "
                  f"| {r['bytes'] / 2**20:.0f} | {r['stored'] / 2**20:.0f} |")  # fmt: skip
        if moto is not None:
            moto.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
