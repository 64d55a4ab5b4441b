"""Cloud detection and instance facts / user-data, against the emulator."""

from __future__ import annotations

import pytest

from spotguard.agent import sources as agent_sources
from spotguard.errors import ConfigError, MetadataUnavailable
from spotguard.notices.base import Cloud
from spotguard.notices.detect import detect_cloud
from spotguard.notices.factory import metadata_source, resolve_cloud, source_for
from spotguard.notices.instance import instance_facts, user_data
from spotguard.notices.settings import NoticeSettings
from spotguard.simulator import MetadataSim, SimClient, SimFacts

S = NoticeSettings()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
async def test_detects_the_one_cloud_that_answers(
    cloud: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with MetadataSim(clouds=(cloud,)) as sim:
        for key, value in sim.env().items():
            monkeypatch.setenv(key, value)
        assert await detect_cloud() is Cloud(cloud)
        settings = NoticeSettings(cloud="auto")  # type: ignore[call-arg]
        assert await resolve_cloud(settings) is Cloud(cloud)
        assert source_for(Cloud(cloud), settings).name == cloud


async def test_nothing_answers(closed_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", closed_url)
    monkeypatch.setenv("GCE_METADATA_HOST", closed_url.removeprefix("http://"))
    monkeypatch.setenv("SPOTGUARD_AZURE_METADATA_ENDPOINT", closed_url)
    assert await detect_cloud() is None
    assert await resolve_cloud(NoticeSettings(cloud="auto")) is None
    with pytest.raises(MetadataUnavailable, match="no cloud metadata service answered"):
        await metadata_source(NoticeSettings(cloud="auto"))
    facts = await instance_facts(await resolve_cloud(S), S)
    assert facts.provider == "local"


async def test_one_cloud_resolver_none_means_no_metadata_source_anywhere() -> None:
    none = NoticeSettings(cloud="none")
    assert await resolve_cloud(none) is None
    assert await agent_sources.cloud_sources(none) == (None, [])
    with pytest.raises(ConfigError, match="cloud = none"):
        await metadata_source(none)
    assert await resolve_cloud(NoticeSettings(cloud="gcp")) is Cloud.GCP


async def test_instance_facts_and_user_data_on_every_cloud(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    facts = SimFacts(
        instance_id="1234567890",
        instance_type="a3-highgpu-8g",
        zone="us-central1-a",
        spot=True,
        user_data="#!/bin/sh\necho restore\n",
    )
    async with MetadataSim(facts=facts) as sim:
        for key, value in sim.env().items():
            monkeypatch.setenv(key, value)
        for cloud in ("aws", "gcp", "azure"):
            got = await instance_facts(cloud, S)
            assert got.provider == cloud
            assert (got.instance_type, got.zone, got.instance_id) == (
                "a3-highgpu-8g",
                "us-central1-a",
                "1234567890",
            )
            assert got.region == "us-central1" and got.spot is True
            assert await user_data(cloud, S) == "#!/bin/sh\necho restore\n"


async def test_user_data_absent_and_gcp_startup_script(monkeypatch: pytest.MonkeyPatch) -> None:
    async with MetadataSim(facts=SimFacts(spot=False)) as sim:
        for key, value in sim.env().items():
            monkeypatch.setenv(key, value)
        for cloud in ("aws", "gcp", "azure"):
            assert await user_data(cloud, S) is None
            assert (await instance_facts(cloud, S)).spot is False
        sim.state.facts = sim.state.facts.updated({"attributes": {"startup-script": "boot"}})
        assert await user_data("gcp", S) == "boot"
        aws = await instance_facts("aws", S)
        assert (aws.zone, aws.region) == ("us-east-1a", "us-east-1")


async def test_imdsv1_host_that_refuses_tokens_gives_its_facts_like_its_notices(
    sim: MetadataSim, client: SimClient
) -> None:
    await client.configure(imdsv1=True)
    await client.fault("error", cloud="aws", path="/latest/api/token", status=403)
    s = NoticeSettings(cloud="aws", imdsv1=True)
    facts = await agent_sources.instance_facts("aws", s)
    want = sim.state.facts
    assert (facts.provider, facts.instance_id, facts.instance_type, facts.zone) == (
        "aws",
        want.instance_id,
        want.instance_type,
        want.zone,
    )
    assert facts.region == want.region_name and facts.spot is True
    source = source_for(Cloud.AWS, s)
    try:
        await client.send("aws", "preempt", action="terminate", in_seconds=120)
        [notice] = await source.poll()  # type: ignore[attr-defined]
        assert notice.action == "terminate"
    finally:
        await source.aclose()
    assert (await client.stats())["counters"].get("aws.unauthorized", 0) == 0
