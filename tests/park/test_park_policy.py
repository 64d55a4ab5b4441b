"""The agent's park policies with real jobs and short windows: an idle job is parked (and the
user told how it comes back), a job busy by CPU or by socket traffic is left alone, a job the
agent is checkpointing is never parked; a higher-priority job makes room by parking the
lowest-priority one, which comes back once the GPU memory is free again."""

from __future__ import annotations

import asyncio
import http.client
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from park_helpers import JOBS, Sg, free_port, ok_json

from spotguard.checkpoint import proctree
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.cuda import NVIDIA_CTL
from spotguard.checkpoint.engine import Engine
from spotguard.checkpoint.jobs import JobInfo, list_jobs, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.park import record
from spotguard.park.policy import ParkPolicy
from spotguard.park.service import ParkService
from spotguard.park.settings import ParkSettings

pytestmark = pytest.mark.criu


def _policy(
    tmp_path: Path, state_dir: Path, criu_bin: str, names: list[str], **park: Any
) -> tuple[ParkPolicy, list[tuple[str, dict[str, Any]]]]:
    cs = CheckpointSettings(state_dir=state_dir, criu=criu_bin, criu_timeout=60)
    ps = ParkSettings(memory_dir=tmp_path / "shm" / "parked", **park)
    sent: list[tuple[str, dict[str, Any]]] = []

    async def notify(event: str, details: dict[str, Any]) -> None:
        sent.append((event, details))

    def jobs() -> list[JobInfo]:
        return [j for j in list_jobs(state_dir) if j.name in names]

    service = ParkService(
        settings=ps, checkpoint=cs, engine=Engine(Criu(criu_bin), settings=cs), notify=notify
    )
    policy = ParkPolicy(service=service, jobs=jobs)
    return policy, sent


def _wait_listening(state_dir: Path, name: str) -> None:
    out = state_dir / "jobs" / name / "stdout"
    deadline = time.monotonic() + 30
    while not (out.exists() and "listening" in out.read_text()):
        assert time.monotonic() < deadline, f"{name} never listened"
        time.sleep(0.05)


class _Client(threading.Thread):
    """Keeps one keep-alive connection busy with a request every 0.1 s."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.answers = 0

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stop.is_set():
            conn.request("GET", "/ping")
            conn.getresponse().read()
            self.answers += 1
            time.sleep(0.1)
        conn.close()


async def test_idle_job_parked_busy_ones_left_alone(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    port = free_port()
    ok_json(sg("run", "--name", "idle", "--json", "--", sys.executable, JOBS, "sleeper"))
    ok_json(sg("run", "--name", "cpu", "--json", "--", sys.executable, JOBS, "busy"))
    ok_json(sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server", str(port)))
    _wait_listening(state_dir, "web")
    client = _Client(port)
    client.start()
    policy, sent = _policy(
        tmp_path, state_dir, criu_bin, ["idle", "cpu", "web"],
        idle_after=2.0, sample_every=0.3, wake_on_connect=False,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while record.load(state_dir, "idle") is None:
            assert time.monotonic() < deadline, "the idle job was never parked"
            await policy.tick()
            await asyncio.sleep(0.3)
        for _ in range(8):  # the busy ones stay busy for a while longer
            await policy.tick()
            await asyncio.sleep(0.3)
    finally:
        client.stop.set()
        client.join(10)
    assert client.answers > 20
    rec = record.load(state_dir, "idle")
    assert rec is not None and rec.reason.startswith("idle for")
    assert record.load(state_dir, "cpu") is None
    assert record.load(state_dir, "web") is None
    assert proctree.alive(resolve_job("cpu", state_dir=state_dir).pid)
    assert proctree.alive(resolve_job("web", state_dir=state_dir).pid)
    events = [(e, d["job"]) for e, d in sent]
    assert events == [("parked", "idle")]
    assert "spotguard unpark idle" in sent[0][1]["comes_back"]
    ok_json(sg("unpark", "idle", "--json"))
    assert proctree.alive(resolve_job("idle", state_dir=state_dir).pid)


async def test_job_being_checkpointed_is_never_parked(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str
) -> None:
    ok_json(sg("run", "--name", "idle", "--json", "--", sys.executable, JOBS, "sleeper"))
    policy, sent = _policy(
        tmp_path, state_dir, criu_bin, ["idle"], idle_after=0.5, sample_every=0.2
    )
    policy.busy = lambda job: True  # e.g. a notice is pending
    for _ in range(10):
        await policy.tick()
        await asyncio.sleep(0.2)
    assert record.load(state_dir, "idle") is None and sent == []


@pytest.mark.skipif(Path(NVIDIA_CTL).exists(), reason="this host has an NVIDIA GPU")
def test_room_asked_on_a_host_without_gpus_is_said_plainly(sg: Sg) -> None:
    """``run --gpu-memory`` where no GPU is known (no GPU NVML sees, no ``[park]
    gpu_capacity_mib``): the job starts, nothing is parked, and the one line says why — not
    that the memory did not fit "even after parking every lower-priority job"."""
    ok_json(sg("run", "--name", "low", "--priority", "1", "--json", "--", sys.executable,
               JOBS, "sleeper"))  # fmt: skip
    res = sg("run", "--name", "big", "--priority", "5", "--gpu-memory", "40G", "--json",
             "--", sys.executable, JOBS, "sleeper")  # fmt: skip
    assert ok_json(res)["parked"] == []
    said = [line for line in res.stderr.splitlines() if "GPU" in line]
    assert len(said) == 1, res.stderr
    assert "no GPU memory known on this node" in said[0] and "gpu_capacity_mib" in said[0]
    assert "Traceback" not in res.stderr


async def test_priority_parks_the_lowest_and_brings_it_back(
    sg: Sg, state_dir: Path, tmp_path: Path, criu_bin: str, config: Path
) -> None:
    text = await asyncio.to_thread(config.read_text)
    await asyncio.to_thread(config.write_text, text + "gpu_capacity_mib = 1000\n")
    ok_json(sg("run", "--name", "low", "--priority", "1", "--gpu-memory", "600M", "--json",
               "--", sys.executable, JOBS, "sleeper"))  # fmt: skip
    ok_json(sg("run", "--name", "mid", "--priority", "3", "--gpu-memory", "300M", "--json",
               "--", sys.executable, JOBS, "sleeper"))  # fmt: skip
    high = ok_json(sg("run", "--name", "high", "--priority", "5", "--gpu-memory", "500M",
                      "--json", "--", sys.executable, JOBS, "sleeper"))  # fmt: skip
    assert high["parked"] == ["low"]  # lowest first, and only as much as needed
    rec = record.load(state_dir, "low")
    assert rec is not None and rec.reason.startswith("priority") and rec.priority == 1
    assert record.load(state_dir, "mid") is None
    # an equal-priority job never makes room
    same = ok_json(sg("run", "--name", "peer", "--priority", "5", "--gpu-memory", "900M",
                      "--json", "--", sys.executable, JOBS, "sleeper"))  # fmt: skip
    assert same["parked"] == []
    ok_json(sg("park", "peer", "--json"))  # out of the way, by hand
    policy, _sent = _policy(
        tmp_path, state_dir, criu_bin, ["low", "mid", "high", "peer"], gpu_capacity_mib=1000
    )
    assert await policy.bring_back() == []  # high still holds its 500 MiB
    hjob = resolve_job("high", state_dir=state_dir)
    proctree.signal_all([hjob.pid], signal.SIGTERM)  # the high-priority job ends
    deadline = time.monotonic() + 30
    while proctree.alive(hjob.pid):
        assert time.monotonic() < deadline, "the high-priority job did not end"
        await asyncio.sleep(0.1)
    assert await policy.bring_back() == ["low"]
    assert record.load(state_dir, "low") is None
    assert proctree.alive(resolve_job("low", state_dir=state_dir).pid)
