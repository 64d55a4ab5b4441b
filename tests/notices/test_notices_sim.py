"""The metadata emulator itself: IMDSv2 enforcement, control API validation, facts, reset."""

from __future__ import annotations

import aiohttp
import pytest

from spotguard.errors import SimulatorError
from spotguard.simulator import MetadataSim, SimClient


async def test_imdsv2_is_enforced(sim: MetadataSim) -> None:
    base = f"{sim.url}/latest"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{base}/meta-data/instance-id") as resp:
            assert resp.status == 401
        async with http.put(f"{base}/api/token") as resp:
            assert resp.status == 400  # the TTL header is required
        ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "30"}
        async with http.put(f"{base}/api/token", headers=ttl) as resp:
            assert resp.status == 200
            token = await resp.text()
        auth = {"X-aws-ec2-metadata-token": token}
        async with http.get(f"{base}/meta-data/instance-id", headers=auth) as resp:
            assert resp.status == 200 and (await resp.text()).startswith("i-")
        async with http.get(f"{base}/meta-data/spot/instance-action", headers=auth) as resp:
            assert resp.status == 404
        async with http.get(f"{base}/meta-data/", headers=auth) as resp:
            listing = (await resp.text()).split("\n")
            assert "instance-id" in listing and "spot/" in listing
        bad = {"X-aws-ec2-metadata-token": "forged"}
        async with http.get(f"{base}/meta-data/instance-id", headers=bad) as resp:
            assert resp.status == 401


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"cloud": "gcp", "kind": "rebalance"}, "gcp has no 'rebalance' notices"),
        ({"cloud": "aws", "kind": "preempt", "action": "explode"}, "action must be one of"),
        ({"cloud": "mars", "kind": "preempt"}, "cloud must be one of"),
        ({"cloud": "aws", "kind": "preempt", "in_seconds": -1}, "seconds must be"),
        ({"cloud": "aws", "kind": "preempt", "colour": "red"}, "unknown fields"),
    ],
)
async def test_control_api_rejects_bad_notices(
    client: SimClient, body: dict[str, object], message: str
) -> None:
    with pytest.raises(SimulatorError, match=message):
        await client._call("POST", "notices", body)


async def test_control_api_unknown_ids_and_faults(client: SimClient) -> None:
    with pytest.raises(SimulatorError, match="no notice"):
        await client.cancel("nope")
    with pytest.raises(SimulatorError, match="fault mode"):
        await client.fault("meltdown")
    fault = await client.fault("error", cloud="aws", count=2, status=500)
    assert fault["status"] == 500
    await client.clear_faults()
    assert await client._call("GET", "faults") == []


async def test_notice_lifecycle_and_reset(client: SimClient) -> None:
    sent = await client.send("aws", "maintenance", in_seconds=60, notice_id="instance-event-1")
    assert sent["id"] == "instance-event-1" and sent["state"] == "active"
    moved = await client.update(sent["id"], in_seconds=3600, action="instance-stop")
    assert moved["action"] == "instance-stop" and moved["in_seconds"] > 3000
    assert (await client.cancel(sent["id"]))["state"] == "cancelled"
    assert [n["id"] for n in await client.notices()] == ["instance-event-1"]
    await client.reset()
    assert await client.notices() == []


async def test_instance_facts_change_at_run_time(sim: MetadataSim, client: SimClient) -> None:
    changed = await client.instance(instance_type="p5.48xlarge", zone="eu-west-1b")
    assert changed["region"] == "eu-west-1"
    headers = {"Metadata": "true"}
    url = f"{sim.url}/metadata/instance/compute/vmSize?api-version=2021-02-01&format=text"
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as resp:
        assert await resp.text() == "p5.48xlarge"
    with pytest.raises(SimulatorError, match="unknown instance fields"):
        await client.instance(gpu="h100")


async def test_unreachable_sim_is_a_clear_error(closed_url: str) -> None:
    async with SimClient(closed_url) as c:
        with pytest.raises(SimulatorError, match="unreachable"):
            await c.notices()
