"""The controller with the AWS provider against a real moto server (EC2, server mode).

Capacity errors and slow launches are injected over real HTTP by
:class:`spotguard.providers.faults.Ec2FaultProxy` in front of moto. The restart test runs
``spotguard controller`` as a subprocess and kills it with SIGKILL in the middle of a launch.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest

from sgtest import free_port
from spotguard.contracts import TAG_JOB, AnyEvent, EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.facts import GpuDevice, GpuInventory
from spotguard.image.settings import ImageSettings
from spotguard.providers.aws import AwsProvider, AwsSettings
from spotguard.providers.faults import Ec2FaultProxy, Fault

TOKEN = "aws-test-token"
REGIONS = ["us-east-1", "us-west-2"]
GIB = 1024**3
OLD = {
    "provider": "aws",
    "instance_id": "i-0123456789abcdef0",
    "instance_type": "g5.xlarge",
    "region": "us-east-1",
    "zone": "us-east-1a",
    "spot": True,
}


def gpus(model: str, count: int, mem_gib: int) -> dict[str, Any]:
    devs = tuple(GpuDevice(i, f"GPU-{i:04d}", model, mem_gib * GIB) for i in range(count))
    return GpuInventory(devs, "580.65.06").to_json()


def make_template(endpoint: str) -> None:
    for region in REGIONS:
        ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
        names = [
            t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]
        ]
        if "spotguard-gpu" not in names:
            image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
            ec2.create_launch_template(
                LaunchTemplateName="spotguard-gpu", LaunchTemplateData={"ImageId": image}
            )


def live_instances(endpoint: str, job: str) -> list[dict[str, Any]]:
    out = []
    for region in REGIONS:
        ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
        resp = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_JOB}", "Values": [job]}])
        for r in resp["Reservations"]:
            out += [i for i in r["Instances"] if i["State"]["Name"] in ("pending", "running")]
    return out


@pytest.fixture
async def proxy(aws_env: str) -> AsyncIterator[Ec2FaultProxy]:
    make_template(aws_env)
    async with Ec2FaultProxy(aws_env) as p:
        yield p


async def post(s: aiohttp.ClientSession, url: str, ev: AnyEvent) -> dict[str, Any]:
    async with s.post(
        url + "/v1/events", data=ev.model_dump_json(), headers={"Authorization": f"Bearer {TOKEN}"}
    ) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def get(s: aiohttp.ClientSession, url: str, path: str) -> dict[str, Any]:
    async with s.get(url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        out: dict[str, Any] = await r.json()
        out["_status"] = r.status
        return out


async def wait_state(
    s: aiohttp.ClientSession, url: str, job: str, state: str, within: float = 30.0
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        try:
            v = await get(s, url, f"/v1/jobs/{job}")
        except aiohttp.ClientError:
            v = {}
        if v.get("state") == state:
            return v
        if loop.time() > end:
            raise AssertionError(f"{job}: {v.get('state')} ({v.get('reason')}), wanted {state}")
        await asyncio.sleep(0.05)


async def interrupt(s: aiohttp.ClientSession, url: str, job: str, gpu: dict[str, Any]) -> None:
    """What an agent reports when a spot notice takes its VM: started, notice, durable, exited."""
    image = f"s3://bucket/{job}/images/20261122T000000000000Z-aaaaaa"
    await post(
        s,
        url,
        make_event(job=job, kind=EventKind.STARTED, instance=OLD, store="s3://bucket"),
    )
    notice = {
        "id": f"{job}-n",
        "cloud": "aws",
        "kind": "preempt",
        "deadline": "2099-01-01T00:00:00Z",
    }
    await post(s, url, make_event(job=job, kind=EventKind.NOTICE, instance=OLD, notice=notice))
    await post(
        s,
        url,
        make_event(
            job=job,
            kind=EventKind.DURABLE,
            instance=OLD,
            image_url=image,
            gpu=gpu,
            host={"kernel": "6.8.0", "arch": "x86_64", "memory_total": 2**34},
        ),
    )
    await post(s, url, make_event(job=job, kind=EventKind.EXITED, instance=OLD, image_url=image))


@pytest.fixture
async def controller(proxy: Ec2FaultProxy, tmp_path: Path) -> AsyncIterator[str]:
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "c.db",
        provider="aws",
        controller_token=TOKEN,
        tick_s=0.05,
        capacity_retry_s=0,
        capacity_rounds=1,
    )
    aws = AwsProvider(
        AwsSettings(
            aws_regions=REGIONS,
            aws_launch_template="spotguard-gpu",
            aws_endpoint_url=proxy.url,
            aws_poll_s=0.05,
            aws_max_attempts=1,
        )
    )
    async with ControllerServer(
        settings, provider=aws, image=ImageSettings.model_validate({})
    ) as srv:
        yield srv.url


def run_calls(proxy: Ec2FaultProxy) -> list[tuple[str, str, str]]:
    return [(c.zone, c.market, c.outcome) for c in proxy.calls if c.action == "RunInstances"]


async def test_capacity_errors_walk_zones_then_regions(
    proxy: Ec2FaultProxy, controller: str, aws_env: str
) -> None:
    zones_east = {"us-east-1a", "us-east-1b", "us-east-1c", "us-east-1d", "us-east-1f"}
    proxy.faults.append(Fault(zones=zones_east))
    async with aiohttp.ClientSession() as s:
        await interrupt(s, controller, "walk", gpus("NVIDIA A10G", 1, 23))
        v = await wait_state(s, controller, "walk", "restoring")
    calls = run_calls(proxy)
    assert [z for z, _, _ in calls] == [
        "us-east-1a",
        "us-east-1b",
        "us-east-1c",
        "us-east-1d",
        "us-east-1f",
        "us-west-2a",
    ]
    assert all(m == "spot" for _, m, _ in calls)
    assert calls[-1][2] == "forwarded"
    assert v["pending"]["zone"] == "us-west-2a"
    assert v["pending"]["instance_type"] == "g5.xlarge"
    assert v["pending"]["market"] == "spot"
    assert sum("no capacity" in h["reason"] for h in v["history"]) == 5
    [inst] = live_instances(aws_env, "walk")
    assert inst["InstanceId"] == v["pending"]["instance_id"]
    # the old instance was queued for termination once the image was durable
    assert any("terminated old instance" in h["reason"] for h in v["history"])


async def test_spot_falls_back_to_on_demand(
    proxy: Ec2FaultProxy, controller: str, aws_env: str
) -> None:
    proxy.faults.append(Fault(market="spot", code="SpotMaxPriceTooLow"))
    async with aiohttp.ClientSession() as s:
        await interrupt(s, controller, "fallback", gpus("NVIDIA A10G", 1, 23))
        v = await wait_state(s, controller, "fallback", "restoring")
    calls = run_calls(proxy)
    spot = [c for c in calls if c[1] == "spot"]
    assert len(spot) == 8  # every zone of both regions offering g5.xlarge, all refused
    assert all(c[2] == "SpotMaxPriceTooLow" for c in spot)
    assert calls[-1] == ("us-east-1a", "on-demand", "forwarded")
    assert v["pending"]["market"] == "on-demand"
    [inst] = live_instances(aws_env, "fallback")
    assert inst.get("InstanceLifecycle") != "spot"


async def test_8xh100_image_lands_on_p5_and_gpu_mismatch_migration_is_refused(
    proxy: Ec2FaultProxy, controller: str, aws_env: str
) -> None:
    async with aiohttp.ClientSession() as s:
        await interrupt(s, controller, "big", gpus("NVIDIA H100 80GB HBM3", 8, 80))
        v = await wait_state(s, controller, "big", "restoring")
        assert v["pending"]["instance_type"] == "p5.48xlarge"
        new = {"provider": "aws", "instance_id": v["pending"]["instance_id"]}
        r = await post(
            s,
            controller,
            make_event(
                job="big",
                kind=EventKind.RESTORED,
                instance=new,
                image_url=v["image_url"],
                gpu=gpus("NVIDIA H100 80GB HBM3", 8, 80),
            ),
        )
        assert r["state"] == "protected"
        async with s.post(
            controller + "/v1/jobs/big/migrate",
            json={"to": "g6.48xlarge"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert "GPU mismatch" in err
        assert "8x l4" in err
        assert "8x h100" in err
        # no matching offer anywhere: the job fails with the reason, nothing crashes
        await interrupt(s, controller, "odd", gpus("NVIDIA A10G", 3, 23))
        v = await wait_state(s, controller, "odd", "failed")
        assert "no offer matches 3x a10g" in v["reason"]


def start_controller(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("spotguard")
    with log.open("ab") as f:
        return subprocess.Popen(
            [str(exe), "--config", str(cfg), "controller"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ},
            start_new_session=True,
        )


async def test_controller_killed_mid_launch_neither_double_launches_nor_forgets(
    proxy: Ec2FaultProxy, aws_env: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f"""
[controller]
listen = "127.0.0.1:{port}"
state = "{tmp_path / "state.db"}"
provider = "aws"
controller_token = "{TOKEN}"
tick_s = 0.05

[aws]
aws_regions = {REGIONS!r}
aws_launch_template = "spotguard-gpu"
aws_endpoint_url = "{proxy.url}"
aws_poll_s = 0.05
aws_max_attempts = 1
""".replace("'", '"')
    )
    # RunInstances reaches moto (the instance exists) but the answer is held back.
    proxy.faults.append(Fault(delay_s=60))
    log = tmp_path / "controller.log"
    proc = start_controller(cfg, log)
    try:
        async with aiohttp.ClientSession() as s:
            loop = asyncio.get_running_loop()
            end = loop.time() + 30
            while True:
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert loop.time() < end, log.read_text()
                await asyncio.sleep(0.1)
            await interrupt(s, url, "survivor", gpus("NVIDIA A10G", 1, 23))
            while not live_instances(aws_env, "survivor"):
                assert loop.time() < end, log.read_text()
                await asyncio.sleep(0.05)
            assert (await get(s, url, "/v1/jobs/survivor"))["state"] == "launching"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proxy.faults.clear()
            proc = start_controller(cfg, log)
            v = await wait_state(s, url, "survivor", "restoring")
            [inst] = live_instances(aws_env, "survivor")
            assert v["pending"]["instance_id"] == inst["InstanceId"]
            assert any("found" in h["reason"] for h in v["history"])
            assert v["restarts"] == 1
            r = await post(
                s,
                url,
                make_event(
                    job="survivor",
                    kind=EventKind.RESTORED,
                    instance={"provider": "aws", "instance_id": inst["InstanceId"]},
                    image_url=v["image_url"],
                ),
            )
            assert r["state"] == "protected"
        assert len(live_instances(aws_env, "survivor")) == 1
        launches = [c for c in proxy.calls if c.action == "RunInstances"]
        assert len(launches) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            # Wait without blocking the event loop: the EC2 proxy lives in it, and a controller
            # shutting down finishes its in-flight EC2 call first.
            await asyncio.to_thread(proc.wait, 10)
