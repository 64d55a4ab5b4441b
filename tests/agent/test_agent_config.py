"""``spotguard --config x.toml agent``: the file is read once and reaches every part (the
deadline planner included), and a second agent on a used port says so in one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from agent_helpers import Host, free_port, job_argv, wait_until

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import JobInfo, start_job

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


@pytest.fixture
async def job(host: Host) -> AsyncIterator[JobInfo]:
    argv = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")
    info = await start_job(argv, "train", state_dir=host.state)
    yield info
    if proctree.alive(info.pid):
        os.kill(info.pid, signal.SIGKILL)


def _config(host: Host, tmp_path: Path, port: int) -> Path:
    cfg = tmp_path / "x.toml"
    cfg.write_text(
        f"""
[checkpoint]
state_dir = "{host.state}"
shm_dir = "{host.shm}"
criu = "{host.criu}"

[agent]
job = ["train"]
store = "file://{tmp_path}/store"
api_listen = "127.0.0.1:{port}"

[notices]
cloud = "none"

[planner]
throughput_file = "{tmp_path}/measured/tp.json"
margin_s = 1.5
"""
    )
    return cfg


async def _spotguard(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        SPOTGUARD, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_config_file_planner_section_reaches_the_agents_checkpoints(
    host: Host, job: JobInfo, tmp_path: Path
) -> None:
    cfg = _config(host, tmp_path, free_port())
    agent = await asyncio.create_subprocess_exec(
        SPOTGUARD, "--config", str(cfg), "agent",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        token = host.state / "agent" / "api.token"
        await wait_until(token.exists, 30)
        rc, out, err = 1, "", ""
        for _ in range(100):
            rc, out, err = await _spotguard("--config", str(cfg), "status", "--json")
            if rc == 0 and json.loads(out)["jobs"]:
                break
            await asyncio.sleep(0.1)
        assert rc == 0, err
        rc, out, err = await _spotguard("--config", str(cfg), "drain", "--json")
        assert rc == 0, err
        answer = json.loads(out)
        assert len(answer["results"]) == 1, out
        [result] = answer["results"]
        assert result["state"] == "exited", result
    finally:
        if agent.returncode is None:
            agent.send_signal(signal.SIGTERM)
        _, agent_err = await asyncio.wait_for(agent.communicate(), 60)
    measured = tmp_path / "measured" / "tp.json"
    assert measured.exists(), "the agent's planner ignored [planner] throughput_file"
    assert not (host.state / "throughput.json").exists()
    assert json.loads(measured.read_text())["runs"] == 1
    assert b"Traceback" not in agent_err


def test_second_agent_on_a_used_port_is_one_line_and_non_zero(host: Host, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = _config(host, tmp_path, port)
        cfg.write_text(cfg.read_text().replace('job = ["train"]', "job = []"))
        proc = subprocess.run(
            [SPOTGUARD, "--config", str(cfg), "agent"], capture_output=True, text=True, timeout=60
        )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors and errors[-1].startswith("spotguard: error:"), proc.stderr
    assert f"127.0.0.1:{port}" in errors[-1] and "in use" in errors[-1], errors[-1]
