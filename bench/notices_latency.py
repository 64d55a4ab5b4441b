"""Notice detection latency and the idle cost of watching.

Starts ``spotguard metadata-sim`` as its own process, then:

* latency — injects a notice N times through the control API and measures the time from the
  injection request to the :class:`~spotguard.notices.base.Notice` leaving the bus, for AWS
  (polling, 1 s by default), GCP (long-poll) and Azure (polling). Injections are spread at
  random over the poll phase, so the numbers sample the whole interval;
* idle cost — runs ``spotguard notices watch`` against the emulator with nothing happening and
  measures its CPU (% of one core) and RSS with psutil.

Usage: ``python -m bench.notices_latency [--n 20] [--interval 1.0] [--idle 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import time
from collections.abc import AsyncIterator

import psutil

from spotguard.notices.aws import AwsImdsSource
from spotguard.notices.azure import AzureEventsSource
from spotguard.notices.base import Notice, NoticeSource
from spotguard.notices.bus import NoticeBus
from spotguard.notices.gcp import GcpMetadataSource
from spotguard.simulator import SimClient


def start_sim() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        ["spotguard", "--log-level", "WARNING", "metadata-sim", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    match = re.search(r"http://[\d.]+:\d+", proc.stdout.readline())
    if not match:
        proc.kill()
        raise SystemExit("metadata-sim did not start")
    return proc, match.group(0)


def sim_env(url: str) -> dict[str, str]:
    return {
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": url + "/",
        "GCE_METADATA_HOST": url.removeprefix("http://"),
        "SPOTGUARD_AZURE_METADATA_ENDPOINT": url,
    }


async def next_notice(stream: AsyncIterator[Notice], cancelled: bool) -> Notice:
    async for notice in stream:
        if notice.cancelled == cancelled:
            return notice
    raise RuntimeError("the bus ended")


async def latency(url: str, cloud: str, source: NoticeSource, n: int, spread: float) -> list[float]:
    """Injection → notice, in seconds, ``n`` times."""
    out = []
    async with SimClient(url) as sim, NoticeBus([source]) as bus:
        stream = aiter(bus)
        await asyncio.sleep(0.5)  # the source is up and polling
        for _ in range(n):
            await asyncio.sleep(random.uniform(0, spread))
            t0 = time.perf_counter()
            sent = await sim.send(cloud, "preempt")
            await next_notice(stream, cancelled=False)
            out.append(time.perf_counter() - t0)
            await sim.cancel(sent["id"])
            await next_notice(stream, cancelled=True)
    return out


def idle_cost(url: str, cloud: str, seconds: float) -> tuple[float, float]:
    """(CPU % of one core, RSS MiB) of ``spotguard notices watch`` with nothing happening."""
    env = {**os.environ, **sim_env(url)}
    proc = subprocess.Popen(
        ["spotguard", "notices", "watch", "--cloud", cloud],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        p = psutil.Process(proc.pid)
        time.sleep(3.0)  # start-up (imports) is not idle cost
        t0, c0 = time.monotonic(), p.cpu_times()
        rss = 0
        end = t0 + seconds
        while time.monotonic() < end:
            time.sleep(1.0)
            rss = max(rss, p.memory_info().rss)
        c1, t1 = p.cpu_times(), time.monotonic()
        cpu = max(0.0, (c1.user + c1.system - c0.user - c0.system) / (t1 - t0) * 100)
        return cpu, rss / 2**20
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)


def row(name: str, xs: list[float], target: str) -> str:
    ms = sorted(x * 1000 for x in xs)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return (
        f"| {name} | {len(ms)} | {ms[0]:.1f} | {statistics.median(ms):.1f} | {p95:.1f} "
        f"| {ms[-1]:.1f} | {target} |"
    )


async def measure(args: argparse.Namespace, url: str) -> list[str]:
    os.environ.update(sim_env(url))
    lines = [
        "| source | n | min ms | median ms | p95 ms | max ms | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    interval = args.interval
    aws = await latency(url, "aws", AwsImdsSource(poll_interval=interval), args.n, spread=interval)
    lines.append(row(f"AWS IMDSv2, poll {interval:g} s", aws, f"≤ {interval * 1000 + 100:.0f}"))
    gcp = await latency(url, "gcp", GcpMetadataSource(), args.n, spread=0.2)
    lines.append(row("GCP long-poll", gcp, "≤ 100"))
    azure = await latency(
        url, "azure", AzureEventsSource(poll_interval=interval), args.n, spread=interval
    )
    lines.append(row(f"Azure events, poll {interval:g} s", azure, f"≤ {interval * 1000 + 100:.0f}"))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20, help="injections per source")
    parser.add_argument("--interval", type=float, default=1.0, help="AWS/Azure poll interval")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle measurement")
    args = parser.parse_args()
    proc, url = start_sim()
    try:
        lines = asyncio.run(measure(args, url))
        lines += [
            "",
            f"| `spotguard notices watch` idle, {args.idle:g} s | CPU % of a core | RSS MiB |",
            "| --- | --- | --- |",
        ]
        for cloud in ("aws", "gcp", "azure"):
            cpu, rss = idle_cost(url, cloud, args.idle)
            lines.append(f"| {cloud} | {cpu:.2f} | {rss:.1f} |")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    cpus = psutil.cpu_count()
    print(
        f"# notices latency — {platform.node()} ({cpus} CPUs, Python {platform.python_version()})"
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
