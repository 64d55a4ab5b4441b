"""The agent's warm-up of the host's free memory (``[agent] warm_memory``,
:mod:`spotguard.warm`): a child process that populates fresh anonymous memory and exits,
first in line for the OOM killer, never below its margin; a setting that is not a size is
refused by name."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spotguard import warm
from spotguard.agent import startup
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.procfacts import start_time
from spotguard.container import ContainerRef, dispatch
from spotguard.errors import ConfigError
from spotguard.image import ImageSettings
from spotguard.sizing import meminfo

GIB = 1 << 30


def test_the_warm_up_child_touches_what_it_is_asked_and_is_first_for_the_oom_killer() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spotguard.warm", "--gib", "0.25", "--threads", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    done = json.loads(out.stdout.strip().splitlines()[-1])
    assert done["bytes"] == GIB // 4 and done["threads"] == 2, done
    assert done["oom_score_adj"] == 1000 and done["seconds"] > 0


_PEAK = """
import sys
from pathlib import Path
from spotguard import warm

def peak():
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(x for x in lines if x.startswith("VmHWM:")).split()[1]) * 1024

before = peak()
touched, _ = warm.touch(int(sys.argv[1]), threads=2, keep=0)
print(touched, peak() - before)
"""


def test_touch_makes_every_page_resident_and_stops_at_the_margin() -> None:
    """Each page populated (the child's peak resident memory grew by what it touched: all
    held at once), every piece unmapped after; a margin above what is available touches
    nothing."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(GIB // 4)], capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    touched, grew = map(int, out.stdout.split())
    assert touched == GIB // 4 and grew >= 0.95 * touched, (touched, grew)
    available = meminfo()["MemAvailable"]
    assert warm.touch(GIB, threads=2, keep=available + GIB)[0] == 0
    assert warm.plan(None, available, available + 1) == 0
    assert warm.plan(3 * GIB, 10 * GIB, GIB) == 3 * GIB
    assert warm.plan(None, 10 * GIB + 12345, GIB) == 9 * GIB


@pytest.mark.parametrize(("value", "gib"), [("auto", None), ("off", 0.0), ("2.5", 2.5)])
def test_the_setting_reads_auto_off_or_a_size(value: str, gib: float | None) -> None:
    assert warm.parse_setting(value) == gib
    assert AgentSettings(warm_memory=value).warm_memory == value


def test_a_setting_that_is_not_a_size_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="warm_memory must be 'auto', 'off' or GiB"):
        warm.parse_setting("lots")
    with pytest.raises(ValueError, match="warm_memory"):
        AgentSettings(warm_memory="-1")


async def test_the_agents_warm_up_logs_what_it_did_once_per_boot_and_off_does_nothing(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, logger="spotguard.warm")
    record = tmp_path / "agent" / "warmed"
    done = await warm.warm_host("0.125", record, [])
    assert done is not None and done.bytes == GIB // 8 and done.oom_score_adj == 1000
    [line] = [r for r in caplog.records if r.getMessage() == "host memory warmed"]
    assert line.__dict__["bytes"] == GIB // 8
    assert record.read_text().strip() == warm._boot_id()
    assert await warm.warm_host("0.125", record, []) is None  # once per boot
    assert await warm.warm_host("off", tmp_path / "other", []) is None
    if not warm.GPU_NODE.exists():
        assert await warm.warm_host("auto", tmp_path / "other", []) is None  # no GPU: off


def _marker(path: Path, pid: int, start: int | None) -> None:
    path.write_text(json.dumps({"op": "freeze", "agent_pid": pid, "agent_start": start}))


def _warm(busy: str) -> int:
    out = subprocess.run(
        [sys.executable, "-m", "spotguard.warm", "--gib", "0.5", "--busy", busy],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return int(json.loads(out.stdout.strip().splitlines()[-1])["bytes"])


def test_the_warm_up_gives_its_memory_back_when_a_freeze_takes_its_marker(
    tmp_path: Path,
) -> None:
    """A crash marker appearing (a freeze or restore began) stops the warm-up at its next
    piece; one already there, held by a live process, stops it before the first."""
    marker = tmp_path / "jobs" / "train" / "operation.json"
    marker.parent.mkdir(parents=True)
    _marker(marker, os.getpid(), start_time("self"))
    busy = str(tmp_path / "jobs" / "*" / "operation.json")
    assert _warm(busy) == 0
    marker.unlink()
    seen: list[int] = []

    def busy_after_two() -> bool:
        seen.append(1)
        return len(seen) > 2

    piece = 64 << 20
    touched, _ = warm.touch(4 * piece, threads=1, keep=0, busy=busy_after_two, piece=piece)
    assert touched == 2 * piece, touched


def test_a_marker_whose_writer_is_gone_does_not_hold_the_warm_up_back(tmp_path: Path) -> None:
    """A leftover marker — its freeze's process dead, one recovery could not clear — stopped
    every warm-up of the boot before its first piece: the fresh VM's first freeze then paid
    the VM's first touch (27.84 s against 14.24 s for 40 GiB, docs/benchmarks.md)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    marker = tmp_path / "markers" / "train-0a1b.json"
    marker.parent.mkdir()
    _marker(marker, dead.pid, 1)
    assert _warm(str(tmp_path / "markers" / "*")) == 1 << 29


async def test_a_container_checkpoint_or_restore_holds_the_warm_up_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A container's checkpoint or restore takes no engine crash marker: it did not stop the
    warm-up, which then competed with it for the VM's fresh pages. Both now hold it back
    while they run (a record of their process under ``containers/busy``)."""
    state = tmp_path / "state"
    busy = startup.warm_busy(state)
    seen: list[int] = []

    async def runs(*args: object, **kwargs: object) -> None:
        done = await warm.warm_host("0.125", tmp_path / f"warmed-{len(seen)}", busy)
        assert done is not None
        seen.append(done.bytes)

    monkeypatch.setattr(dispatch, "checkpoint_container", runs)
    monkeypatch.setattr(dispatch, "restore_container", runs)
    podman: Any = object()  # neither containerd nor docker: podman's functions, replaced
    ref = ContainerRef.parse("podman:web")
    await dispatch.checkpoint(ref, "file:///nowhere", backend=podman, state_dir=state)
    await dispatch.restore("file:///nowhere/x", backend=podman, image_settings=ImageSettings(),
                           state_dir=state)  # fmt: skip
    assert seen == [0, 0]
    assert list((state / "containers" / "busy").iterdir()) == []  # gone once they are done
    done = await warm.warm_host("0.125", tmp_path / "warmed-after", busy)
    assert done is not None and done.bytes == GIB // 8
