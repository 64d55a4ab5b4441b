"""AWS provider against a real moto server (EC2 in server mode) over HTTP.

Capacity errors are injected by :class:`spotguard.providers.faults.Ec2FaultProxy`, an HTTP
proxy in front of moto that answers EC2's own error XML for chosen zones/markets.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest

from spotguard.contracts import TAG_JOB, TAG_MANAGED, Assignment
from spotguard.errors import CapacityError, PrecheckError, UnknownInstanceType
from spotguard.facts import GpuDevice, GpuInventory, InstanceFacts
from spotguard.providers.aws import AwsProvider, AwsSettings
from spotguard.providers.base import TAG_LAUNCH, InstanceState, LaunchSpec, Market
from spotguard.providers.faults import Ec2FaultProxy, Fault

REGIONS = ["us-east-1", "us-west-2"]
GIB = 1024**3


def gpu_spec(model: str, count: int, mem_gib: int) -> LaunchSpec:
    inv = GpuInventory(
        tuple(GpuDevice(i, f"GPU-{i}", model, mem_gib * GIB) for i in range(count)), "580.65.06"
    )
    return LaunchSpec.from_facts(inv, InstanceFacts(provider="aws"), {"arch": "x86_64"})


def make_template(endpoint: str, region: str) -> None:
    ec2 = boto3.client("ec2", region_name=region, endpoint_url=endpoint)
    names = [t["LaunchTemplateName"] for t in ec2.describe_launch_templates()["LaunchTemplates"]]
    if "spotguard-gpu" in names:
        return
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ec2.create_launch_template(
        LaunchTemplateName="spotguard-gpu", LaunchTemplateData={"ImageId": image}
    )


@pytest.fixture
async def proxy(aws_env: str) -> AsyncIterator[Ec2FaultProxy]:
    for r in REGIONS:
        make_template(aws_env, r)
    async with Ec2FaultProxy(aws_env) as p:
        yield p


def provider_for(proxy: Ec2FaultProxy) -> AwsProvider:
    return AwsProvider(
        AwsSettings(
            aws_regions=REGIONS,
            aws_launch_template="spotguard-gpu",
            aws_endpoint_url=proxy.url,
            aws_poll_s=0.05,
            aws_max_attempts=1,
        )
    )


def assignment(job: str = "train-1") -> Assignment:
    return Assignment(job=job, image_url=f"file:///s/{job}/images/x", store="file:///s")


def instances_tagged(endpoint: str, job: str) -> list[dict[str, Any]]:
    out = []
    for r in REGIONS:
        ec2 = boto3.client("ec2", region_name=r, endpoint_url=endpoint)
        resp = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_JOB}", "Values": [job]}])
        for res in resp["Reservations"]:
            out += [i for i in res["Instances"] if i["State"]["Name"] != "terminated"]
    return out


async def test_matching_picks_p5_for_8xh100_and_g5_xlarge_for_1xa10g(
    proxy: Ec2FaultProxy,
) -> None:
    p = provider_for(proxy)
    try:
        h100 = await p.offers(gpu_spec("NVIDIA H100 80GB HBM3", 8, 80))
        assert h100
        assert {o.instance_type for o in h100} == {"p5.48xlarge"}
        assert h100[0].gpu_count == 8
        assert h100[0].gpu_model == "h100"
        a10g = await p.offers(gpu_spec("NVIDIA A10G", 1, 23))
        assert a10g[0].instance_type == "g5.xlarge"
        assert a10g[0].market is Market.SPOT
        assert {o.region for o in a10g} == set(REGIONS)
        # types with another GPU never appear
        assert all(o.gpu_model == "a10g" and o.gpu_count == 1 for o in a10g)
        with pytest.raises(UnknownInstanceType, match=r"p9\.nonesuch"):
            await p.instance_type("p9.nonesuch")
        assert await p.offers(gpu_spec("NVIDIA B300", 3, 1)) == []
    finally:
        await p.aclose()


async def test_launch_sets_spot_options_tags_user_data_and_is_found_by_token(
    proxy: Ec2FaultProxy, aws_env: str
) -> None:
    p = provider_for(proxy)
    a = assignment("tags-job")
    try:
        offer = (await p.offers(gpu_spec("NVIDIA A10G", 1, 23)))[0]
        ref = await p.launch(offer, a, client_token="round1-0")
        assert ref.zone == offer.zone
        ref = await p.wait_ready(ref, 10)
        assert ref.state is InstanceState.RUNNING
        assert ref.market is Market.SPOT
        ec2 = boto3.client("ec2", region_name=offer.region, endpoint_url=aws_env)
        inst = ec2.describe_instances(InstanceIds=[ref.instance_id])["Reservations"][0][
            "Instances"
        ][0]
        tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
        assert tags[TAG_MANAGED] == "true"
        assert tags[TAG_JOB] == "tags-job"
        assert tags[TAG_LAUNCH] == "round1"
        assert inst["InstanceType"] == "g5.xlarge"
        assert inst.get("InstanceLifecycle") == "spot"
        ud = ec2.describe_instance_attribute(InstanceId=ref.instance_id, Attribute="userData")
        script = base64.b64decode(ud["UserData"]["Value"]).decode()
        assert script == a.user_data()
        assert Assignment.from_user_data(script) == a
        vols = ec2.describe_volumes(
            Filters=[{"Name": "attachment.instance-id", "Values": [ref.instance_id]}]
        )["Volumes"]
        for v in vols:
            assert {t["Key"]: t["Value"] for t in v.get("Tags", [])}.get(TAG_JOB) == "tags-job"
        found = await p.find_by_token("round1")
        assert found is not None
        assert found.instance_id == ref.instance_id
        assert await p.find_by_token("no-such-round") is None
        await p.terminate(ref)
        gone = await p.describe(ref)
        assert gone.state is InstanceState.TERMINATED
        assert gone.state_reason is not None  # EC2's StateReason: why it ended
        assert "shutdown" in gone.state_reason.lower(), gone.state_reason
        await p.terminate(ref)  # idempotent
    finally:
        await p.aclose()


async def test_capacity_errors_are_typed_and_precheck_errors_too(proxy: Ec2FaultProxy) -> None:
    p = provider_for(proxy)
    try:
        offer = (await p.offers(gpu_spec("NVIDIA A10G", 1, 23)))[0]
        proxy.faults.append(Fault(zones={offer.zone}))
        with pytest.raises(CapacityError, match="InsufficientInstanceCapacity"):
            await p.launch(offer, assignment(), client_token="r2-0")
        proxy.faults[:] = [Fault(zones={offer.zone}, code="SpotMaxPriceTooLow", market="spot")]
        with pytest.raises(CapacityError, match="SpotMaxPriceTooLow"):
            await p.launch(offer, assignment(), client_token="r2-1")
        proxy.faults[:] = [Fault(code="UnauthorizedOperation", status=403)]
        with pytest.raises(PrecheckError, match="UnauthorizedOperation"):
            await p.launch(offer, assignment(), client_token="r2-2")
    finally:
        await p.aclose()
