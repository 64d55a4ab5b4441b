"""Issue 28.3: a job started with ``spotguard run`` is protected by the running agent without
a config edit (the agent finds it in its state dir), ``--no-protect`` opts out, and ``run``
says which agent protects the job or that none runs. Real processes: ``spotguard agent``,
``spotguard run``, ``spotguard status``."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgtest import free_port as _free_port
from spotguard.agent import discovery
from spotguard.checkpoint.jobs import NO_PROTECT, JobInfo, list_jobs, start_job

SG = [sys.executable, "-m", "spotguard"]
LOOP = ["sh", "-c", "while :; do sleep 0.2; done"]


@pytest.fixture
def host(tmp_path: Path) -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("spotguard run needs root")
    env = dict(os.environ)
    env |= {
        "SPOTGUARD_CONFIG": "/dev/null",
        "SPOTGUARD_STATE_DIR": str(tmp_path / "state"),
        "SPOTGUARD_STORE": f"file://{tmp_path / 'store'}",
        "SPOTGUARD_API_LISTEN": f"127.0.0.1:{_free_port()}",
        "SPOTGUARD_NOTICES_CLOUD": "none",
        "SPOTGUARD_DISCOVER_INTERVAL_S": "0.3",
    }
    yield env
    for job in list_jobs(tmp_path / "state"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(job.pid, signal.SIGKILL)


def run(env: dict[str, str], *args: str) -> str:
    out = subprocess.run([*SG, "run", *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def status(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run([*SG, "status", "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def test_a_job_run_by_spotguard_run_is_protected_without_a_config_edit(
    host: dict[str, str],
) -> None:
    alone = run(host, "--name", "before", "--", *LOOP)
    assert "not protected: no spotguard agent is running on this host" in alone

    agent = subprocess.Popen(
        [*SG, "agent"], env=host, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        for _ in range(100):
            probe = subprocess.run([*SG, "status", "--json"], env=host, capture_output=True)
            if probe.returncode == 0:
                break
            assert agent.poll() is None, agent.communicate()[1]
            time.sleep(0.2)
        said = run(host, "--name", "train", "--", *LOOP)
        assert f"job train is protected by the agent (pid {agent.pid}" in said, said
        opted = run(host, "--name", "scratch", "--no-protect", "--", *LOOP)
        assert "job scratch is not protected (--no-protect)" in opted, opted
        jobs: dict[str, object] = {}
        for _ in range(100):
            answer = status(host)
            jobs = {j["job"]: j for j in answer["jobs"]}  # type: ignore[attr-defined]
            if {"train", "before"} <= set(jobs):
                break
            time.sleep(0.2)
        # the job started before the agent, and the one started after it: both protected
        assert {"train", "before"} <= set(jobs), jobs
        time.sleep(1.0)  # several discovery rounds
        assert "scratch" not in {j["job"] for j in status(host)["jobs"]}  # type: ignore[attr-defined]
        text = subprocess.run([*SG, "status"], env=host, capture_output=True, text=True).stdout
        assert "train" in text and "scratch" not in text.split("no job protected")[0]
    finally:
        agent.terminate()
        _, err = agent.communicate(timeout=30)
    assert "protecting a job started by spotguard run" in err


async def test_a_no_protect_job_is_opted_out_before_discovery_can_see_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--no-protect`` was written after the job's ``job.json``: an agent's discovery round
    in between (a loaded host, a clean-clone CI run) protected the job. The opt-out is now in
    the job's directory before its ``job.json`` is."""
    seen: list[bool] = []
    save = JobInfo.save

    def watched(self: JobInfo) -> None:
        seen.append((self.dir / NO_PROTECT).exists())
        save(self)

    monkeypatch.setattr(JobInfo, "save", watched)
    job = await start_job(
        [sys.executable, "-c", "import time; time.sleep(30)"], "scratch",
        state_dir=tmp_path / "state", protect=False,
    )  # fmt: skip
    try:
        assert seen == [True], "the job could be discovered before its opt-out"
        assert discovery.candidates(tmp_path / "state", []) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGKILL)
