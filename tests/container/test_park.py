"""``spotguard park podman:NAME`` / ``unpark`` with real podman and CRIU: in memory (paused),
to disk (podman's own checkpoint) and to a store (a spotguard image, the container removed);
the job makes no progress while parked and its output after three parks is byte-identical to
an uninterrupted run's (every number once, in order). An agent guards the container all the
while: it shows it parked, never finished, and guards it again once unparked."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from podman_helpers import IMAGE, Vm

from sgtest import free_port, wait_for
from sgtest import wait_lines as _wait_lines

#: counts until told to stop (a file in its bind mount): however slow the machine, it is still
#: running at each park
JOB = "exec >>/data/out; i=0; while [ ! -e /data/stop ]; do echo $i; i=$((i+1)); sleep 0.1; done"


def _cli(vm: Vm, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        ["spotguard", args[0], "--json", *args[1:]],
        env=vm.cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _agent_job(vm: Vm, port: int) -> dict[str, Any]:
    """The agent's status of its one job (its local API)."""
    token = (vm.state_dir / "agent" / "api.token").read_text().strip()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        jobs: list[dict[str, Any]] = json.loads(r.read())["jobs"]
    return jobs[0] if jobs else {}


def _lines(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def test_a_parked_container_makes_no_progress_and_unparks_where_it_stopped(
    vms: tuple[Vm, Vm],
) -> None:
    vm1, _ = vms
    data = vm1.state_dir.parent / "park-data"
    data.mkdir()
    out = data / "out"
    _cli(vm1, "run", "--container", "podman:nb", "-v", f"{data}:/data", "--", IMAGE,
         "/bin/sh", "-c", JOB)  # fmt: skip
    store = f"file://{vm1.state_dir.parent / 'park-store'}"
    port = free_port()
    env = {**vm1.cli_env(), "SPOTGUARD_API_LISTEN": f"127.0.0.1:{port}"}
    spotguard = str(Path(sys.executable).with_name("spotguard"))
    agent_log = vm1.state_dir.parent / "agent.log"
    with agent_log.open("ab") as log:
        agent = subprocess.Popen(
            [spotguard, "agent", "--job", "podman:nb", "--store", store, "--cloud", "none"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: (vm1.state_dir / "agent" / "api.token").exists(), "the agent's API")
        wait_for(lambda: _agent_job(vm1, port).get("state") == "protecting", "protection", 30)
        for n, to in enumerate(("memory", "disk", store), start=1):
            _wait_lines(out, 5 * n)
            pid = _agent_job(vm1, port)["pid"]
            parked = _cli(vm1, "park", "podman:nb", "--to", to)
            assert parked["place"] == ("store" if to == store else to), parked
            held = _lines(out)
            time.sleep(0.6)
            assert _lines(out) == held, f"the job ran while parked ({to})"
            if to != "memory":  # paused: its processes are still there, frozen
                wait_for(lambda: _agent_job(vm1, port)["state"] != "protecting", "the agent", 10)
                assert _agent_job(vm1, port)["state"] == "parked", f"parked to {to}"
            if to == store:  # reported to the controller as parked, with its image
                # the agent's reporter logs the event as it sends it, after the park's answer
                wait_for(lambda: "event=parked" in agent_log.read_text(), "the park report", 10)
                said = agent_log.read_text()
                reported = re.findall(r"event=parked job=(\S+) \S+ image=(\S+)", said)
                assert reported == [("podman-nb", parked["image_url"])], said[-3000:]
            back = _cli(vm1, "unpark", "podman:nb")
            assert back["place"] == parked["place"]
            if to != "memory":
                wait_for(lambda old=pid: _agent_job(vm1, port)["pid"] != old, "a new guard", 10)
                job = _agent_job(vm1, port)
                assert (job["state"], job["container"]) == ("protecting", "podman:nb"), job
        # parked in memory (paused) when a drain comes: the agent's exit checkpoint saves it
        # (podman cannot checkpoint a paused container: the agent unpauses it first)
        _wait_lines(out, _lines(out) + 3)
        _cli(vm1, "park", "podman:nb", "--to", "memory")
        ran = subprocess.run(
            ["spotguard", "drain", "--json", "--reason", "test"],
            env=env, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert ran.returncode == 0, agent_log.read_text()[-4000:]
        drained = json.loads(ran.stdout)
        [saved] = drained["results"]
        assert saved.get("url") and not saved.get("error"), drained
        assert vm1.podman_cmd("ps", "-a", "-q") == ""  # exit mode: removed once durable
        assert not (vm1.state_dir / "containers/parked/nb.json").exists()  # not parked now
        _cli(vm1, "restore", saved["url"])  # and it counts on from there (checked below)
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(30)
    _wait_lines(out, _lines(out) + 5)
    (data / "stop").touch()
    end = time.monotonic() + 30
    while "Exited" not in vm1.podman_cmd("ps", "-a", "--format", "{{.Status}}"):
        assert time.monotonic() < end, "the job did not end"
        time.sleep(0.1)
    text = out.read_text()
    assert text == "".join(f"{i}\n" for i in range(text.count("\n")))
