"""How an agent reaches its controller (issue 27, item 7): never in clear text off the host,
and a token on the command line or in a config file is flagged.

Before: ``--controller-url http://10.0.0.5:8700`` (or the same from an assignment) made the
agent send its bearer token in clear to the network; ``--controller-token`` (visible in ``ps``
to every user) was taken silently. Now a plain-HTTP URL that is not loopback refuses the
agent's start with one line, and an inline token logs one warning naming the safe ways
(``--controller-token-file``, ``SPOTGUARD_CONTROLLER_TOKEN``). Real agent processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sec_helpers import Attacker

from sgtest import free_port as _port
from spotguard.agent.settings import AgentSettings
from spotguard.config import load
from spotguard.errors import ConfigError

TOKEN = "s3cr3t-controller-token"
WARNING = "controller token given inline"


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    """``spotguard [--config C] agent`` on a private state dir and file store, no assignment."""
    return [
        "--state-dir", str(tmp_path / "state"), "--store", f"file://{tmp_path / 'store'}",
        "--assignment", str(tmp_path / "assignment.json"),
        "--api-listen", f"127.0.0.1:{_port()}",
    ]  # fmt: skip


def _agent(
    args: list[str], *, env: dict[str, str] | None = None, config: Path | None = None
) -> subprocess.Popen[str]:
    cfg = ["--config", str(config)] if config else []
    return subprocess.Popen(
        [sys.executable, "-m", "spotguard", *cfg, "agent", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _refused(proc: subprocess.Popen[str]) -> str:
    """The agent must end at once with one line (no traceback); its output."""
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the agent started and ran:\n{out[-2000:]}")
    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    return out.strip().splitlines()[-1]


def _started(proc: subprocess.Popen[str]) -> str:
    """Wait for the agent to be up, stop it (SIGTERM) and return everything it logged."""
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        lines.append(line)
        if "local API listening" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    out = "".join(lines) + rest
    assert "local API listening" in out, out
    return out


@pytest.fixture
def stop_all() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.5:8700", "http://controller.example.com", "http://0.0.0.0:8700",
     "http://[2001:db8::1]:8700"],
)  # fmt: skip
def test_a_plain_http_controller_off_this_host_refuses_the_agent(
    base: list[str], url: str, stop_all: list[subprocess.Popen[str]]
) -> None:
    proc = _agent([*base, "--controller-url", url, "--controller-token-file", "/dev/null"])
    stop_all.append(proc)
    line = _refused(proc)
    assert line.startswith("spotguard: error:") and "controller_url" in line, line
    assert url.split("://")[1].split(":")[0].strip("[]") in line and "https" in line, line
    # the same from the environment
    proc = _agent(base, env={"SPOTGUARD_CONTROLLER_URL": url})
    stop_all.append(proc)
    assert "controller_url" in _refused(proc)


def test_an_assignment_naming_a_plain_http_controller_off_this_host_refuses_the_agent(
    base: list[str], tmp_path: Path, stop_all: list[subprocess.Popen[str]]
) -> None:
    assignment = tmp_path / "assignment.json"
    body = {
        "job": "train",
        "image_url": f"file://{tmp_path}/store/train/images/1",
        "store": f"file://{tmp_path / 'store'}",
        "controller_url": "http://192.0.2.7:8700",
        "controller_token": "sgvm1.train.0.x",
    }
    assignment.write_text(json.dumps(body))
    assignment.chmod(0o600)
    proc = _agent(base)
    stop_all.append(proc)
    line = _refused(proc)
    assert "192.0.2.7" in line and "https" in line, line
    # the controller's private-network mode says so in the assignment: the agent starts
    assignment.write_text(json.dumps(body | {"insecure_controller": True}))
    proc = _agent(base)
    stop_all.append(proc)
    assert "192.0.2.7" in _started(proc)


def test_https_and_loopback_controllers_are_accepted() -> None:
    for url in ("https://controller.example.com:8700", "http://127.0.0.1:8700",
                "http://localhost:8700", "http://[::1]:8700", "http://127.0.0.2"):  # fmt: skip
        assert load(AgentSettings, {"controller_url": url}).controller_url == url
    for bad in ("ftp://controller.example.com", "controller.example.com:8700", "http://"):
        with pytest.raises(ConfigError, match="controller_url"):
            load(AgentSettings, {"controller_url": bad})


def test_a_token_on_the_command_line_is_refused_with_one_line(
    base: list[str], stop_all: list[subprocess.Popen[str]]
) -> None:
    """``ps`` shows every process's arguments to every user: no command takes a token there."""
    url = f"http://127.0.0.1:{_port()}"
    proc = _agent([*base, "--controller-url", url, "--controller-token", TOKEN])
    stop_all.append(proc)
    line = _refused(proc)
    assert line.startswith("spotguard: error: --controller-token"), line
    assert "SPOTGUARD_CONTROLLER_TOKEN" in line and "controller_token_file" in line, line
    assert TOKEN not in line, line
    for argv in (["controller", "--token", TOKEN, "--issue-token", "train"],
                 ["jobs", "list", "--controller-token", TOKEN]):  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "spotguard", *argv], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        (line,) = out.stderr.strip().splitlines()
        assert "SPOTGUARD_CONTROLLER_TOKEN" in line and "controller_token_file" in line, line
        assert TOKEN not in line, line


def test_an_inline_token_in_the_config_file_warns_once_a_file_or_the_environment_does_not(
    base: list[str], tmp_path: Path, stop_all: list[subprocess.Popen[str]]
) -> None:
    url = f"http://127.0.0.1:{_port()}"
    # in a config file: works, and says once that others may read it
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(f'[agent]\ncontroller_url = "{url}"\ncontroller_token = "{TOKEN}"\n')
    proc = _agent(base, config=cfg)
    stop_all.append(proc)
    out = _started(proc)
    assert out.count(WARNING) == 1, out
    line = next(ln for ln in out.splitlines() if WARNING in ln)
    assert "controller_token_file" in line and "SPOTGUARD_CONTROLLER_TOKEN" in line, line
    assert TOKEN not in line, line
    # from a file, or from the environment: no warning
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    proc = _agent([*base, "--controller-url", url, "--controller-token-file", str(tok)])
    stop_all.append(proc)
    assert WARNING not in _started(proc)
    proc = _agent([*base, "--controller-url", url], env={"SPOTGUARD_CONTROLLER_TOKEN": TOKEN})
    stop_all.append(proc)
    assert WARNING not in _started(proc)


def test_another_user_sees_no_token_in_ps_for_an_agent_started_as_documented(
    base: list[str], tmp_path: Path, attacker: Attacker, stop_all: list[subprocess.Popen[str]]
) -> None:
    """docs/agent.md: the token in a file (--controller-token-file, the unit's config) or in
    SPOTGUARD_CONTROLLER_TOKEN. An ordinary user of the host lists every process's arguments
    while the agents run and finds neither token (the agents' own arguments it does see)."""
    url = f"http://127.0.0.1:{_port()}"
    tok = tmp_path / "token"
    tok.write_text(TOKEN)
    tok.chmod(0o600)
    env_token = TOKEN + "-from-env"
    by_file = _agent([*base, "--controller-url", url, "--controller-token-file", str(tok)])
    stop_all.append(by_file)
    _wait_listening(by_file)
    base2 = [*base[:-1], f"127.0.0.1:{_port()}"]
    base2[1] = str(tmp_path / "state2")
    by_env = _agent(
        [*base2, "--controller-url", url], env={"SPOTGUARD_CONTROLLER_TOKEN": env_token}
    )
    stop_all.append(by_env)
    _wait_listening(by_env)
    # the two agents' arguments as the other user lists them (only theirs: other tests run
    # at the same time, one of them giving a token on the command line to see it refused)
    pids = f"{by_file.pid},{by_env.pid}"
    seen = attacker.run("ps", "-ww", "-o", "args", "-p", pids).stdout
    assert str(tok) in seen and str(tmp_path / "state2") in seen, seen[-3000:]
    assert TOKEN not in seen, "the token is in ps"


def _wait_listening(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        if "local API listening" in line:
            return
        assert time.monotonic() < deadline, "the agent did not start"
    pytest.fail(f"the agent stopped: exit {proc.wait()}")
