"""Real jobs with sockets, parked and unparked back to back with no flags (real CRIU):
a forked worker pair over a socketpair and loopback TCP, and a listening HTTP server.

Each is started with ``spotguard run``, checkpointed in exit mode (to a directory, or to a
``file://`` store), restored at once on the same host, and its output compared exactly
with what an uninterrupted run prints.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from ckpt_helpers import lines, wait_exit, wait_for

from sgtest import sg_env
from spotguard.checkpoint import proctree, selftest_job
from spotguard.checkpoint.jobs import resolve_job

pytestmark = [pytest.mark.criu, pytest.mark.slow]

PROGS = Path(__file__).parent / "progs"


@pytest.fixture
def env(criu_bin: str, state_dir: Path) -> dict[str, str]:
    return {**os.environ, "SPOTGUARD_STATE_DIR": str(state_dir), "SPOTGUARD_CRIU": criu_bin}


def _scan_detail(result: dict[str, object]) -> dict[str, object]:
    timeline = result["timeline"]
    assert isinstance(timeline, list)
    (scan,) = [s for s in timeline if s["name"] == "scan"]
    detail = scan["detail"]
    assert isinstance(detail, dict)
    return detail


async def test_worker_pair_over_socketpair_and_loopback_tcp_parks_and_unparks(
    env: dict[str, str], state_dir: Path, tmp_path: Path
) -> None:
    args = ["120", "0.05"]
    out = sg_env("run", "--json", "--name", "pair", "--", sys.executable, "-I",
               selftest_job.__file__, *args, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = resolve_job("pair", state_dir=state_dir)
    await wait_for(lambda: len(lines(job.dir / "stdout")) >= 5, "five steps", 60)
    pids = proctree.tree(job.pid)

    out = sg_env("checkpoint", "pair", "--to", str(tmp_path / "img"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    detail = _scan_detail(json.loads(out.stdout))
    assert detail["tcp_established"] is True and detail["tcp_external"] == 0
    assert detail["network_lock"] in ("nftables", "iptables", "skip")
    await wait_for(lambda: not any(proctree.alive(p) for p in pids), "the job to stop")

    out = sg_env("restore", str(tmp_path / "img"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert await wait_exit(resolve_job("pair", state_dir=state_dir)) == 0
    # what an uninterrupted run prints (tests/checkpoint/test_realjobs_doctor.py runs one)
    assert (job.dir / "stdout").read_text() == selftest_job.expected(120)
    assert (job.dir / "stderr").read_text() == ""


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


async def test_listening_http_server_answers_the_same_after_park_and_unpark(
    env: dict[str, str], state_dir: Path, tmp_path: Path
) -> None:
    port_file = tmp_path / "port"
    out = sg_env("run", "--name", "http", "--", sys.executable, str(PROGS / "http_job.py"),
               str(port_file), env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = resolve_job("http", state_dir=state_dir)
    await wait_for(port_file.exists, "the server to listen")
    port = int(port_file.read_text())
    first = _get(port, "/a").split()
    assert first[1:] == ["1", "/a"]
    secret = first[0]

    store = f"file://{tmp_path / 'store'}"
    out = sg_env("checkpoint", "http", "--to", store, "--json", env=env)
    assert out.returncode == 0, out.stderr
    image_url = json.loads(out.stdout)["image_url"]
    await wait_for(lambda: not proctree.alive(job.pid), "the server to stop")
    with pytest.raises(OSError):
        _get(port, "/while-parked")

    out = sg_env("restore", image_url, "--json", env=env)
    assert out.returncode == 0, out.stderr
    # the same process: the secret made at start-up, the counter where it was
    assert _get(port, "/b") == f"{secret} 2 /b"
    assert _get(port, "/quit") == f"{secret} 3 /quit"
    assert await wait_exit(resolve_job("http", state_dir=state_dir)) == 0
    served = ["served 1 /a", "served 2 /b", "served 3 /quit"]
    assert lines(job.dir / "stdout") == ["listening", *served]


async def _park_unpark(name: str, argv: list[str], env: dict[str, str], state_dir: Path,
                      image: Path) -> str:  # fmt: skip
    """Run ``argv`` as a job, checkpoint it (exit) to ``image`` once it has printed five
    steps, restore it at once on this host, wait for it to end; its whole stdout."""
    return (await _park_unpark_timed(name, argv, env, state_dir, image))[0]


async def _park_unpark_timed(name: str, argv: list[str], env: dict[str, str], state_dir: Path,
                             image: Path) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """:func:`_park_unpark`, and the detail of the restore's ``criu_restore`` step."""
    out = sg_env("run", "--json", "--name", name, "--", *argv, env=env)
    assert out.returncode == 0, out.stderr
    job = resolve_job(name, state_dir=state_dir)
    await wait_for(lambda: len(lines(job.dir / "stdout")) >= 5, "five steps", 60)
    pids = proctree.tree(job.pid)
    out = sg_env("checkpoint", name, "--to", str(image), env=env)
    assert out.returncode == 0, out.stderr
    await wait_for(lambda: not any(proctree.alive(p) for p in pids), "the job to stop")
    out = sg_env("restore", str(image), "--json", env=env)
    assert out.returncode == 0, out.stderr
    steps = {s["name"]: s for s in json.loads(out.stdout)["timeline"]}
    assert await wait_exit(resolve_job(name, state_dir=state_dir)) == 0
    return (job.dir / "stdout").read_text(), steps["criu_restore"]["detail"]


async def test_a_deleted_shared_memory_file_it_maps_is_carried(
    env: dict[str, str], state_dir: Path, tmp_path: Path
) -> None:
    # NCCL's proxy maps a deleted /dev/shm/nccl-* file of 34 MB; CRIU's default limit for
    # such "ghost" files is 1 MiB ("Can't dump ghost file ... increase limit")
    argv = [sys.executable, "-I", str(PROGS / "shm_ghost.py"), "100", "0.05"]  # 5 s: see below
    run = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, check=True)
    assert await _park_unpark("ghost", argv, env, state_dir, tmp_path / "img") == run.stdout


async def test_sockets_never_bound_are_carried(
    env: dict[str, str], state_dir: Path, tmp_path: Path
) -> None:
    """A TCP and a UDPv6 socket created and never bound: in no /proc/net table (the freeze
    refused them as "an unsupported family"); CRIU carries them. The job counts 5 s (at 2 s a
    loaded clean-clone run's ``spotguard checkpoint`` found it ended: "No such process")."""
    argv = [sys.executable, "-I", str(PROGS / "hold.py"), "unbound", "100", "0.05"]
    run = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True, check=True)
    assert await _park_unpark("unbound", argv, env, state_dir, tmp_path / "img") == run.stdout


async def test_a_listener_whose_closed_connections_wait_is_restored_on_the_same_host(
    env: dict[str, str], state_dir: Path, tmp_path: Path
) -> None:
    # restored within 60 s on the host it ran on: the connection it accepted and closed is in
    # TIME_WAIT on the listener's port, and binding it failed ("Address already in use")
    argv = [sys.executable, "-I", str(PROGS / "listener_closed.py"), "100", "0.05"]
    got, detail = await _park_unpark_timed("lsn", argv, env, state_dir, tmp_path / "img")
    assert got.splitlines() == [f"step {i}" for i in range(100)]
    # the closed connections were cleared from the port before CRIU bound it: no retry
    # waited out their 60 s (an NCCL job unparked on its host waited ~50 s)
    assert detail["retry_wait_s"] < 1
    assert detail["time_wait_cleared"] >= 1
