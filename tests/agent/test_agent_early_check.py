"""The agent says at once — in status and a log line, not when a notice comes — that a job
it protects holds something no checkpoint can carry (here: a process adopted by pid whose
session leader is outside its PID namespace), and keeps protecting it; a job in a session of
its own shows nothing (real processes, a real agent over its own API)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from spotguard.agent.daemon import Agent
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint import proctree
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.image import ImageSettings
from spotguard.notices.settings import NoticeSettings

pytestmark = pytest.mark.criu


def _agent(tmp_path: Path, criu_bin: str, pids: list[int]) -> Agent:
    """An agent protecting ``pids``, its store and state under ``tmp_path``, no cloud."""
    return Agent(
        AgentSettings(
            job=[str(p) for p in pids], store=(tmp_path / "store").as_uri(),
            api_listen="127.0.0.1:0", assignment=tmp_path / "none.json",
        ),
        CheckpointSettings(state_dir=tmp_path / "state", criu=criu_bin),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )  # fmt: skip


async def test_status_names_what_no_checkpoint_could_carry_from_the_start(
    tmp_path: Path, criu_bin: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="spotguard.agent.worker")
    outer = await asyncio.create_subprocess_exec(
        "unshare", "--pid", "--fork", "--kill-child", "sleep", "120"
    )
    own = await asyncio.create_subprocess_exec("sleep", "120", start_new_session=True)
    try:
        for _ in range(100):
            if len(proctree.tree(outer.pid)) == 2:
                break
            await asyncio.sleep(0.05)
        inner = proctree.tree(outer.pid)[1]
        agent = _agent(tmp_path, criu_bin, [inner, own.pid])
        run = asyncio.create_task(agent.run())
        try:
            for _ in range(200):
                jobs = {j["pid"]: j for j in agent.status()["jobs"]}
                if inner in jobs and any(jobs[inner]["cannot_checkpoint"]):
                    break
                await asyncio.sleep(0.05)
            jobs = {j["pid"]: j for j in agent.status()["jobs"]}
            (why,) = jobs[inner]["cannot_checkpoint"]
            assert why.startswith(f"pid {inner} (sleep) holds a session whose session leader")
            assert "setsid" in why
            assert jobs[inner]["state"] == "protecting"  # still protected: it may let go
            assert jobs[own.pid]["cannot_checkpoint"] == []
            assert any("cannot be checkpointed as it is" in r.getMessage() for r in caplog.records)
        finally:
            agent.request_stop()
            await asyncio.wait_for(run, 60)
    finally:
        for proc in (outer, own):
            proc.kill()
            await proc.wait()


async def test_the_agent_loads_the_gpu_driver_at_start_and_says_what_it_found(
    tmp_path: Path, criu_bin: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading cuda-core, ``cuInit`` and NVML take 0.6-0.9 s on the GPU machines measured
    (docs/benchmarks.md): the agent does it at start, not inside the first notice's window.
    On this host there is no NVIDIA driver, and the line says so."""
    caplog.set_level("INFO", logger="spotguard.agent.startup")
    own = await asyncio.create_subprocess_exec("sleep", "120", start_new_session=True)
    try:
        agent = _agent(tmp_path, criu_bin, [own.pid])
        run = asyncio.create_task(agent.run())
        try:
            for _ in range(200):
                lines = [r for r in caplog.records if "GPU checkpoint API" in r.getMessage()]
                if lines:
                    break
                await asyncio.sleep(0.05)
            (line,) = lines
            has_gpu = await asyncio.to_thread(os.path.exists, "/dev/nvidiactl")
            assert line.__dict__["gpu_driver"] is has_gpu
            if not has_gpu:
                assert line.getMessage() == "no GPU checkpoint API on this host"
                assert "no NVIDIA driver" in line.__dict__["reason"]
            assert not run.done()  # the agent goes on either way
        finally:
            agent.request_stop()
            await asyncio.wait_for(run, 60)
    finally:
        own.kill()
        await own.wait()


async def test_status_names_open_files_too_large_for_a_checkpoint_from_the_start(
    tmp_path: Path, criu_bin: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A job holding an output file over ``max_file_bytes`` or a deleted file over
    ``ghost_limit`` would be refused at the notice; the agent says so when it starts
    protecting the job (small limits, so the files are small)."""
    caplog.set_level("WARNING", logger="spotguard.agent.worker")
    out, gone = tmp_path / "out.bin", tmp_path / "gone.bin"
    script = (
        f"exec 3>{out}; head -c 8192 /dev/zero >&3; "
        f"exec 4<>{gone}; head -c 16384 /dev/zero >&4; rm {gone}; exec sleep 120"
    )
    big = await asyncio.create_subprocess_exec("sh", "-c", script, start_new_session=True)
    agent = Agent(
        AgentSettings(
            job=[str(big.pid)], store=(tmp_path / "store").as_uri(),
            api_listen="127.0.0.1:0", assignment=tmp_path / "none.json",
        ),
        CheckpointSettings(
            state_dir=tmp_path / "state", criu=criu_bin, max_file_bytes=4096, ghost_limit=4096
        ),
        NoticeSettings(cloud="none"),
        image=ImageSettings(),
    )  # fmt: skip
    try:
        for _ in range(100):  # the shell has become sleep, holding both files
            comm = await asyncio.to_thread(Path(f"/proc/{big.pid}/comm").read_text)
            if comm.strip() == "sleep":
                break
            await asyncio.sleep(0.02)
        run = asyncio.create_task(agent.run())
        try:
            for _ in range(200):
                jobs = {j["pid"]: j for j in agent.status()["jobs"]}
                if big.pid in jobs and jobs[big.pid]["cannot_checkpoint"]:
                    break
                await asyncio.sleep(0.05)
            found = jobs[big.pid]["cannot_checkpoint"]
            assert len(found) == 2, found
            too_big = next(f for f in found if "max_file_bytes" in f)
            assert str(out) in too_big and "8192 bytes" in too_big
            ghost = next(f for f in found if "ghost_limit" in f)
            assert str(gone) in ghost and "16384 bytes" in ghost
            assert jobs[big.pid]["state"] == "protecting"
            (line,) = [r for r in caplog.records if "cannot be checkpointed" in r.getMessage()]
            assert "max_file_bytes" in line.__dict__["reason"]
        finally:
            agent.request_stop()
            await asyncio.wait_for(run, 60)
    finally:
        big.kill()
        await big.wait()
