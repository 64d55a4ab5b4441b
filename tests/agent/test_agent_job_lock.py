"""One agent per job across state dirs: two real ``spotguard agent`` processes, each with its
own ``--state-dir``, told to protect the same job. Both used to protect it and both dumps
failed at the notice ("another freeze is in progress"); now the second refuses with one line,
and its status says why (the job lock, keyed by the job's boot id, pid and start time)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sgtest import free_port, wait_for, without_spotguard_settings

pytestmark = pytest.mark.criu

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
TOKEN = "job-lock-test"


def _status(port: int) -> dict[str, Any] | None:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            answer: dict[str, Any] = json.load(r)
            return answer
    except (OSError, urllib.error.URLError):
        return None


def _job_state(port: int) -> dict[str, Any] | None:
    st = _status(port)
    return st["jobs"][0] if st and st["jobs"] else None


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _agent(tmp_path: Path, name: str, pid: int, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [SPOTGUARD, "agent", "--job", str(pid), "--store", (tmp_path / "store").as_uri(),
         "--cloud", "none", "--state-dir", str(tmp_path / name),
         "--api-listen", f"127.0.0.1:{port}", "--assignment", str(tmp_path / "none.json")],
        env=without_spotguard_settings(SPOTGUARD_API_TOKEN=TOKEN),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_agents_on_other_state_dirs_one_protects_the_job_the_other_refuses(
    tmp_path: Path, job: subprocess.Popen[bytes]
) -> None:
    """Both agents start at once; whichever locks first protects the job."""
    ports = {"a": free_port(), "b": free_port()}
    agents = {name: _agent(tmp_path, name, job.pid, port) for name, port in ports.items()}
    try:
        wait_for(lambda: all(_job_state(p) for p in ports.values()), "both agents' status")
        states = {name: _job_state(port) or {} for name, port in ports.items()}
        (keeper,) = [n for n, st in states.items() if st["state"] == "protecting"]
        (other,) = [n for n, st in states.items() if st["state"] == "stood_down"]
        reason = states[other]["reason"]
        assert f"another agent (pid {agents[keeper].pid}" in reason, reason
        assert str(tmp_path / keeper) in reason, reason
        assert states[keeper]["reason"] is None
    finally:
        for agent in agents.values():
            agent.terminate()
    errs = {name: agent.communicate(timeout=60)[1] for name, agent in agents.items()}
    lines = [ln for ln in errs[other].splitlines() if "another agent protects this job" in ln]
    assert len(lines) == 1, errs[other][-3000:]
    assert "another agent protects this job" not in errs[keeper]


def test_a_holder_that_has_not_written_its_name_yet_is_still_named(tmp_path: Path) -> None:
    """The holder locks the file, then writes its pid: an agent that finds the lock taken in
    between used to report "pid ?". It now waits a moment for the holder's name."""
    import fcntl
    import os
    import threading

    from spotguard.agent import joblock
    from spotguard.agent.identity import read

    ident = read(os.getpid())
    assert ident is not None
    root = tmp_path / "locks"
    root.mkdir(mode=0o700)
    fd = os.open(root / joblock._key(ident), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    late = threading.Timer(0.2, lambda: os.pwrite(fd, b"pid 4242, state dir /x", 0))
    late.start()
    try:
        lock = joblock.take(ident, tmp_path / "b", root)
        assert lock.other == "another agent (pid 4242, state dir /x) protects this job"
    finally:
        late.join()
        os.close(fd)


def test_a_state_dir_holder_that_has_not_written_its_pid_yet_is_still_named(
    tmp_path: Path,
) -> None:
    """The same window on the state dir lock: it used to say "another agent (pid ?)"."""
    import fcntl
    import os
    import threading

    from spotguard.agent.startup import lock_state_dir
    from spotguard.errors import ConfigError
    from spotguard.statedir import StateDir

    layout = StateDir(tmp_path / "state")
    layout.agent.mkdir(parents=True)
    fd = os.open(layout.agent_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    late = threading.Timer(0.2, lambda: os.pwrite(fd, b"4242\n", 0))
    late.start()
    try:
        with pytest.raises(ConfigError, match=r"another agent \(pid 4242\)"):
            lock_state_dir(layout)
    finally:
        late.join()
        os.close(fd)
