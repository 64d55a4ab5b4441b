"""``spotguard park podman:NAME`` / ``unpark`` with real podman and CRIU: in memory (paused),
to disk (podman's own checkpoint) and to a store (a spotguard image, the container removed);
the job makes no progress while parked and its output after three parks is byte-identical to
an uninterrupted run's (every number once, in order)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from podman_helpers import IMAGE, Vm

from sgtest import wait_lines as _wait_lines

#: counts until told to stop (a file in its bind mount): however slow the machine, it is still
#: running at each park
JOB = "exec >>/data/out; i=0; while [ ! -e /data/stop ]; do echo $i; i=$((i+1)); sleep 0.1; done"


def _cli(vm: Vm, *args: str) -> dict[str, object]:
    out = subprocess.run(
        ["spotguard", args[0], "--json", *args[1:]],
        env=vm.cli_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


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
    for n, to in enumerate(("memory", "disk", store), start=1):
        _wait_lines(out, 5 * n)
        parked = _cli(vm1, "park", "podman:nb", "--to", to)
        assert parked["place"] == ("store" if to == store else to), parked
        held = _lines(out)
        time.sleep(0.6)
        assert _lines(out) == held, f"the job ran while parked ({to})"
        back = _cli(vm1, "unpark", "podman:nb")
        assert back["place"] == parked["place"]
    _wait_lines(out, _lines(out) + 5)
    (data / "stop").touch()
    end = time.monotonic() + 30
    while "Exited" not in vm1.podman_cmd("ps", "-a", "--format", "{{.Status}}"):
        assert time.monotonic() < end, "the job did not end"
        time.sleep(0.1)
    text = out.read_text()
    assert text == "".join(f"{i}\n" for i in range(text.count("\n")))
