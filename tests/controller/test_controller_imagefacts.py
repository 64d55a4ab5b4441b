"""GPU facts from the image itself: a real image written by ``spotguard.image.push_dir`` into a
``file://`` store, whose manifest ``meta`` records the engine's GPU/host/instance facts, makes the
AWS provider (moto, server mode) launch the matching type — when the controller falls back to
the store's newest image (the agent died before any DURABLE report), and when the DURABLE
report it got carries no GPU facts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest

from spotguard.contracts import AnyEvent, EventKind, make_event
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.facts import GpuDevice, GpuInventory, HostFacts
from spotguard.image import push_dir
from spotguard.image.settings import ImageSettings
from spotguard.providers.aws import AwsProvider, AwsSettings

TOKEN = "imagefacts-token"
GIB = 1024**3
# What the agent's instance-facts report says when the metadata service answered only the id.
VM = {"provider": "aws", "instance_id": "i-0aaaabbbbccccdddd", "region": "us-east-1"}


def a10g(count: int) -> dict[str, Any]:
    devs = tuple(GpuDevice(i, f"GPU-{i:04d}", "NVIDIA A10G", 23 * GIB) for i in range(count))
    return GpuInventory(devs, "580.65.06").to_json()


async def write_image(tmp_path: Path, store: str, job: str, gpus: int, itype: str) -> str:
    """A real image with the meta the checkpoint pipeline records (gpu, host, instance)."""
    src = tmp_path / f"img-{job}"
    src.mkdir()
    (src / "pages-1.img").write_bytes(b"\x01" * 4096)
    meta = {
        "gpu": a10g(gpus),
        "host": HostFacts("6.1.0", "x86_64", 64 * GIB, "4.1.1").to_json(),
        "instance": {
            "provider": "aws",
            "instance_type": itype,
            "region": "us-east-1",
            "zone": "us-east-1b",
            "instance_id": VM["instance_id"],
            "spot": True,
        },
        "criu_version": "4.1.1",
    }
    result = await push_dir(src, store, job, meta, settings=ImageSettings())
    return result.image_url


@pytest.fixture
async def controller(aws_env: str, tmp_path: Path) -> AsyncIterator[str]:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=aws_env)
    names = [t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]]
    if "spotguard-gpu" not in names:
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        ec2.create_launch_template(
            LaunchTemplateName="spotguard-gpu", LaunchTemplateData={"ImageId": image}
        )
    settings = ControllerSettings(
        listen="127.0.0.1:0",
        state=tmp_path / "c.db",
        provider="aws",
        controller_token=TOKEN,
        default_store=f"file://{tmp_path}/store",
        tick_s=0.05,
        capacity_retry_s=0,
    )
    aws = AwsProvider(
        AwsSettings(
            aws_regions=["us-east-1"],
            aws_launch_template="spotguard-gpu",
            aws_endpoint_url=aws_env,
            aws_poll_s=0.05,
            aws_max_attempts=1,
        )
    )
    async with ControllerServer(
        settings, provider=aws, image=ImageSettings.model_validate({})
    ) as srv:
        yield srv.url


async def post(s: aiohttp.ClientSession, url: str, ev: AnyEvent) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with s.post(url + "/v1/events", data=ev.model_dump_json(), headers=headers) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def wait_restoring(s: aiohttp.ClientSession, url: str, job: str) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while True:
        async with s.get(
            url + f"/v1/jobs/{job}", headers={"Authorization": f"Bearer {TOKEN}"}
        ) as r:
            view: dict[str, Any] = await r.json()
        if view["state"] in ("restoring", "failed"):
            return view
        assert loop.time() < end, view
        await asyncio.sleep(0.05)


async def test_fallback_to_newest_image_launches_for_the_manifests_gpus(
    controller: str, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    await write_image(tmp_path, store, "died", 1, "g5.xlarge")
    async with aiohttp.ClientSession() as s:
        await post(s, controller, make_event(job="died", kind=EventKind.STARTED, instance=VM))
        # The VM went away without any DURABLE report: only the store knows the image.
        r = await post(s, controller, make_event(job="died", kind=EventKind.EXITED, instance=VM))
        assert r["state"] == "interrupting"
        view = await wait_restoring(s, controller, "died")
    assert view["state"] == "restoring", view["reason"]
    assert view["image_url"].startswith(f"{store}/died/images/")
    assert view["pending"]["instance_type"] == "g5.xlarge"
    assert view["pending"]["zone"] == "us-east-1b"  # where the image says the job ran
    assert (view["spec"]["gpu_model"], view["spec"]["gpu_count"]) == ("a10g", 1)
    assert view["spec"]["driver_major"] == 580
    assert any(
        h["reason"].startswith("launch spec from the image's manifest: 1x a10g")
        and "reports said no GPU" in h["reason"]
        for h in view["history"]
    )


async def test_durable_report_without_gpu_facts_uses_the_manifest(
    controller: str, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    url = await write_image(tmp_path, store, "quad", 4, "g5.12xlarge")
    notice = {"id": "n-q", "cloud": "aws", "kind": "preempt", "deadline": "2099-01-01T00:00:00Z"}
    async with aiohttp.ClientSession() as s:
        for ev in (
            make_event(job="quad", kind=EventKind.STARTED, instance=VM),
            make_event(job="quad", kind=EventKind.NOTICE, instance=VM, notice=notice),
            make_event(job="quad", kind=EventKind.DURABLE, instance=VM, image_url=url),
            make_event(job="quad", kind=EventKind.EXITED, instance=VM, image_url=url),
        ):
            await post(s, controller, ev)
        view = await wait_restoring(s, controller, "quad")
    assert view["state"] == "restoring", view["reason"]
    assert view["pending"]["instance_type"] == "g5.12xlarge"
    assert view["spec"]["gpu_count"] == 4
