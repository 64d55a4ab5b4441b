"""Every number from the config file, the environment, the command line or the agent's API is
bounded where it is parsed (issue 31, item 16): ``periodic_interval = inf`` or ``1e308``,
``drain --deadline 1e308`` are one clear typed line (exit 2, or a 400 from the API), never a
systemd restart loop (OverflowError at protect time) or a 500; and a drain that wrote no
image does not stay live to checkpoint a job the operator starts by hand afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from agent_helpers import EventSink, Host, job_argv, running_agent, wait_until

from spotguard.agent.client import call
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import start_job
from spotguard.errors import SpotguardError

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
LONG_JOB = job_argv("--steps", "4000", "--step-seconds", "0.05", "--mb", "4", "--gpu", "no")


async def _agent_until_exit(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``spotguard ... agent``: its exit status and stderr (killed after 20 s: it ran on)."""
    proc = await asyncio.create_subprocess_exec(
        SPOTGUARD, *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    except TimeoutError:
        proc.send_signal(signal.SIGKILL)
        _, err = await proc.communicate()
        return -1, "the agent started and ran on: " + err.decode()[-2000:]
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@pytest.mark.parametrize(
    ("where", "value"),
    [("file", "inf"), ("file", "1e308"), ("file", "nan"), ("env", "1e308"), ("flag", "inf")],
)
async def test_an_unbounded_periodic_interval_is_refused_in_one_line(
    host: Host, tmp_path: Path, where: str, value: str
) -> None:
    cfg = tmp_path / "x.toml"
    text = (
        f'[checkpoint]\nstate_dir = "{host.state}"\n'
        f'[agent]\nstore = "file://{tmp_path}/store"\napi_listen = "127.0.0.1:0"\n'
        f'assignment = "{tmp_path}/none.json"\n[notices]\ncloud = "none"\n'
    )
    env: dict[str, str] = {}
    flags: list[str] = []
    if where == "file":
        text = text.replace("[notices]", f"periodic_interval = {value}\n[notices]")
    elif where == "env":
        env["SPOTGUARD_PERIODIC_INTERVAL"] = value
    else:
        flags = ["--periodic-interval", value]
    cfg.write_text(text)
    rc, err = await _agent_until_exit("--config", str(cfg), "agent", *flags, env=env)
    assert rc == 2, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("spotguard: error:") and "periodic_interval" in last, err


async def test_a_drain_deadline_out_of_range_is_a_400_and_one_cli_line(
    host: Host, tmp_path: Path
) -> None:
    store = f"file://{tmp_path}/store"
    async with running_agent(host, None, cloud="none", store=store) as agent:
        await wait_until(lambda: agent.api is not None)
        assert agent.api is not None
        token = (host.state / "agent" / "api.token").read_text().strip()
        for bad in (1e308, 10 * 86400.0):
            with pytest.raises(SpotguardError, match=r"answered 400: deadline_s must be"):
                await call(agent.api.address, token, "POST", "/drain", {"deadline_s": bad})
        proc = await asyncio.create_subprocess_exec(
            SPOTGUARD, "drain", "--deadline", "1e308", "--state-dir", str(host.state),
            "--api-listen", agent.api.address,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        text = err.decode()
        assert proc.returncode == 2, text
        assert "Traceback" not in text and "--deadline" in text, text
        assert agent.manual.active() == []


@pytest.mark.criu
async def test_a_drain_that_wrote_no_image_does_not_checkpoint_a_job_started_after_it(
    host: Host, sink: EventSink, tmp_path: Path
) -> None:
    """The operator drains while the job is down (nothing to do, no image), then starts it
    by hand: the old agent kept the drain live for its 120 s and stopped the job again at
    once; now a drain ends with its outcome."""
    store = f"file://{tmp_path}/store"
    async with running_agent(host, sink, cloud="none", job=["train"], store=store) as agent:
        await wait_until(lambda: agent.api is not None)
        answer = await agent.drain("kernel upgrade", wait=True, deadline_s=None)
        assert not any(r.get("url") for r in answer["results"]), answer
        job = await start_job(LONG_JOB, "train", state_dir=host.state)
        try:
            await wait_until(lambda: "started" in sink.kinds("train"), 30)
            await asyncio.sleep(3.0)
            assert proctree.alive(job.pid), "the finished drain stopped the job"
            assert agent.workers["train"].state == "protecting"
            assert "durable" not in sink.kinds("train"), sink.kinds("train")
        finally:
            if proctree.alive(job.pid):
                os.kill(job.pid, signal.SIGKILL)
