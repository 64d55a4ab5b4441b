"""GCP provider against a local HTTP fake of the Compute Engine REST API.

No Compute Engine emulator exists (Google ships none, and none is on PyPI or npm), so this
module serves the few Compute REST resources the provider uses — machineTypes, acceleratorTypes,
instances (insert/get/list/delete) and zone operations — from an aiohttp app, with numeric
``id`` fields and operations as GCE returns them. ``google-cloud-compute`` talks to it over
real HTTP through ``ClientOptions(api_endpoint=...)`` with anonymous credentials. Zones can be
marked exhausted: inserts there end in an operation error ``ZONE_RESOURCE_POOL_EXHAUSTED``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from spotguard.contracts import LABEL_JOB, LABEL_MANAGED, Assignment
from spotguard.errors import CapacityError, UnknownInstanceType
from spotguard.facts import GpuDevice, GpuInventory, InstanceFacts
from spotguard.providers.base import InstanceState, LaunchSpec, Market
from spotguard.providers.gcp import GcpProvider, GcpSettings

PROJECT = "sg-test"
ZONES = ["us-central1-a", "us-central1-b", "europe-west4-a"]
GIB = 1024**3


def machine_types(zone: str) -> list[dict[str, Any]]:
    def mt(name: str, cpus: int, mem_mb: int, acc: str | None = None, n: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "compute#machineType",
            "id": str(abs(hash((zone, name))) % 10**12),
            "name": name,
            "guestCpus": cpus,
            "memoryMb": mem_mb,
            "zone": zone,
        }
        if acc:
            out["accelerators"] = [{"guestAcceleratorType": acc, "guestAcceleratorCount": n}]
        return out

    return [
        mt("n1-standard-8", 8, 30720),
        mt("a3-highgpu-8g", 208, 1916928, "nvidia-h100-80gb", 8),
        mt("a2-highgpu-1g", 12, 87040, "nvidia-tesla-a100", 1),
        mt("g2-standard-4", 4, 16384, "nvidia-l4", 1),
        mt("g2-standard-8", 8, 32768, "nvidia-l4", 1),
    ]


class FakeCompute:
    """The Compute REST resources the provider uses, in memory."""

    def __init__(self) -> None:
        self.instances: dict[tuple[str, str], dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.exhausted: set[str] = set()
        self.inserts: list[tuple[str, dict[str, Any], str]] = []
        self.ids = itertools.count(4_000_000_000_000_000_001)

    def app(self) -> web.Application:
        app = web.Application()
        base = "/compute/v1/projects/{project}/zones/{zone}"
        app.router.add_get(base + "/machineTypes", self.list_machine_types)
        app.router.add_get(base + "/acceleratorTypes", self.list_accelerators)
        app.router.add_post(base + "/instances", self.insert)
        app.router.add_get(base + "/instances", self.list_instances)
        app.router.add_get(base + "/instances/{name}", self.get)
        app.router.add_delete(base + "/instances/{name}", self.delete)
        app.router.add_get(base + "/operations/{op}", self.get_operation)
        return app

    @staticmethod
    def error(code: int, message: str, reason: str) -> web.Response:
        body = {"error": {"code": code, "message": message, "errors": [{"reason": reason}]}}
        return web.json_response(body, status=code)

    def operation(
        self, zone: str, kind: str, target: str, error: str | None = None
    ) -> dict[str, Any]:
        op: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(next(self.ids)),
            "name": f"operation-{len(self.operations) + 1}",
            "zone": zone,
            "operationType": kind,
            "targetLink": target,
            "status": "DONE",
            "progress": 100,
        }
        if error:
            op["error"] = {"errors": [{"code": error, "message": f"{error} in {zone}"}]}
            op["httpErrorStatusCode"] = 503
            op["httpErrorMessage"] = "SERVICE UNAVAILABLE"
        self.operations[op["name"]] = op
        return op

    async def list_machine_types(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        return web.json_response({"kind": "compute#machineTypeList", "items": machine_types(zone)})

    async def list_accelerators(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        items = [
            {
                "kind": "compute#acceleratorType",
                "id": "10071",
                "name": "nvidia-tesla-t4",
                "zone": zone,
                "maximumCardsPerInstance": 4,
            }
        ]
        return web.json_response({"kind": "compute#acceleratorTypeList", "items": items})

    async def insert(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        body = await request.json()
        self.inserts.append((zone, body, request.query.get("requestId", "")))
        name = body["name"]
        if zone in self.exhausted:
            return web.json_response(
                self.operation(zone, "insert", name, "ZONE_RESOURCE_POOL_EXHAUSTED")
            )
        if (zone, name) in self.instances:
            return self.error(409, f"The resource '{name}' already exists", "alreadyExists")
        self.instances[(zone, name)] = {
            **body,
            "kind": "compute#instance",
            "id": str(next(self.ids)),
            "zone": zone,
            "status": "PROVISIONING",
        }
        return web.json_response(self.operation(zone, "insert", name))

    async def get(self, request: web.Request) -> web.Response:
        key = (request.match_info["zone"], request.match_info["name"])
        inst = self.instances.get(key)
        if inst is None:
            return self.error(404, f"The resource '{key[1]}' was not found", "notFound")
        out = dict(inst)
        if inst["status"] == "PROVISIONING":
            inst["status"] = "RUNNING"  # boots by the next look
        return web.json_response(out)

    async def list_instances(self, request: web.Request) -> web.Response:
        zone = request.match_info["zone"]
        flt = request.query.get("filter", "")
        m = re.match(r'labels\.([\w-]+) = "(.*)"', flt)
        items = [
            i
            for (z, _), i in self.instances.items()
            if z == zone and (m is None or i.get("labels", {}).get(m.group(1)) == m.group(2))
        ]
        return web.json_response({"kind": "compute#instanceList", "items": items})

    async def delete(self, request: web.Request) -> web.Response:
        zone, name = request.match_info["zone"], request.match_info["name"]
        if self.instances.pop((zone, name), None) is None:
            return self.error(404, f"The resource '{name}' was not found", "notFound")
        return web.json_response(self.operation(zone, "delete", name))

    async def get_operation(self, request: web.Request) -> web.Response:
        return web.json_response(self.operations[request.match_info["op"]])


@pytest.fixture
async def compute() -> AsyncIterator[tuple[FakeCompute, str]]:
    fake = FakeCompute()
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield fake, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def provider(endpoint: str) -> GcpProvider:
    return GcpProvider(
        GcpSettings(
            gcp_project=PROJECT, gcp_zones=ZONES, gcp_api_endpoint=endpoint, gcp_poll_s=0.05
        )
    )


def spec(model: str, count: int, mem_gib: int, zone: str | None = None) -> LaunchSpec:
    inv = GpuInventory(tuple(GpuDevice(i, f"GPU-{i}", model, mem_gib * GIB) for i in range(count)))
    return LaunchSpec.from_facts(inv, InstanceFacts(provider="gcp", zone=zone))


async def test_catalog_matches_bundled_and_attached_gpus(compute: tuple[FakeCompute, str]) -> None:
    _, url = compute
    p = provider(url)
    try:
        h100 = await p.offers(spec("NVIDIA H100 80GB HBM3", 8, 80))
        assert {o.instance_type for o in h100} == {"a3-highgpu-8g"}
        assert [o.zone for o in h100 if o.market is Market.SPOT] == ZONES
        l4 = await p.offers(spec("NVIDIA L4", 1, 22))
        assert l4[0].instance_type == "g2-standard-4"  # the smallest type with 1x L4
        a100 = await p.offers(spec("NVIDIA A100-SXM4-40GB", 1, 40))
        assert a100[0].instance_type == "a2-highgpu-1g"
        t4 = await p.offers(spec("Tesla T4", 2, 15))
        assert t4[0].instance_type == "n1-standard-8+nvidia-tesla-t4x2"
        assert p.regions() == ["us-central1", "europe-west4"]
        with pytest.raises(UnknownInstanceType, match="a9-nothing"):
            await p.instance_type("a9-nothing")
    finally:
        await p.aclose()


async def test_launch_spot_with_labels_startup_script_then_zone_failover(
    compute: tuple[FakeCompute, str],
) -> None:
    fake, url = compute
    p = provider(url)
    a = Assignment(job="gcp.job", image_url="gs://b/gcp.job/images/x", store="gs://b")
    try:
        offers = [o for o in await p.offers(spec("NVIDIA L4", 1, 22)) if o.market is Market.SPOT]
        fake.exhausted.add(offers[0].zone)
        with pytest.raises(CapacityError, match="ZONE_RESOURCE_POOL_EXHAUSTED"):
            await p.launch(offers[0], a, client_token="r1-0")
        nxt = next(o for o in offers if o.zone != offers[0].zone)
        ref = await p.launch(nxt, a, client_token="r1-1")
        assert ref.zone == "us-central1-b"
        assert ref.market is Market.SPOT
        ref = await p.wait_ready(ref, 5)
        assert ref.state is InstanceState.RUNNING
        zone, body, request_id = fake.inserts[-1]
        assert zone == "us-central1-b"
        assert len(request_id) == 36  # a UUID derived from the client token
        assert body["scheduling"]["provisioningModel"] == "SPOT"
        assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
        assert body["labels"] == {
            LABEL_MANAGED: "true",
            LABEL_JOB: "gcp_job",
            "spotguard-launch": "r1",
        }
        items = {i["key"]: i["value"] for i in body["metadata"]["items"]}
        assert items["startup-script"] == a.user_data()
        assert Assignment.from_user_data(items["user-data"]) == a
        found = await p.find_by_token("r1")
        assert found is not None
        assert found.instance_id == ref.instance_id
        # the same client token again: no second instance
        again = await p.launch(nxt, a, client_token="r1-1")
        assert again.instance_id == ref.instance_id
        assert len(fake.instances) == 1
        await p.terminate(ref)
        assert (await p.describe(ref)).state is InstanceState.TERMINATED
        assert await p.find_by_token("r1") is None
    finally:
        await p.aclose()


async def test_attached_gpu_launch_sets_guest_accelerators(
    compute: tuple[FakeCompute, str],
) -> None:
    fake, url = compute
    p = provider(url)
    a = Assignment(job="t4job", image_url="gs://b/t4job/images/x", store="gs://b")
    try:
        offer = next(
            o for o in await p.offers(spec("Tesla T4", 1, 15)) if o.market is Market.ON_DEMAND
        )
        await p.launch(offer, a, client_token="r2-0")
        _, body, _ = fake.inserts[-1]
        assert body["machineType"].endswith("/machineTypes/n1-standard-8")
        [acc] = body["guestAccelerators"]
        assert acc["acceleratorType"].endswith("/acceleratorTypes/nvidia-tesla-t4")
        assert acc["acceleratorCount"] == 1
        assert body["scheduling"]["provisioningModel"] == "STANDARD"
    finally:
        await p.aclose()


async def test_each_job_launches_under_its_own_service_account(
    compute: tuple[FakeCompute, str],
) -> None:
    """terraform/gcp gives every job its own agent service account (only it reads the job's
    prefix and the fleet's signing key): the controller launches each job's VM as that
    account (``gcp_job_service_accounts``), others as ``gcp_service_account``."""
    fake, url = compute
    p = GcpProvider(
        GcpSettings(
            gcp_project=PROJECT, gcp_zones=ZONES, gcp_api_endpoint=url, gcp_poll_s=0.05,
            gcp_service_account="fallback@p.iam.gserviceaccount.com",
            gcp_job_service_accounts={"train": "sg-1a2b@p.iam.gserviceaccount.com"},
        )
    )  # fmt: skip
    try:
        offer = (await p.offers(spec("NVIDIA L4", 1, 22)))[0]
        for job, token in (("train", "r3-0"), ("other", "r4-0")):
            a = Assignment(job=job, image_url=f"gs://b/{job}/images/x", store="gs://b")
            await p.launch(offer, a, client_token=token)
        emails = [body["serviceAccounts"][0]["email"] for _z, body, _r in fake.inserts]
        assert emails == ["sg-1a2b@p.iam.gserviceaccount.com", "fallback@p.iam.gserviceaccount.com"]
    finally:
        await p.aclose()
