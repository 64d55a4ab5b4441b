"""``spotguard demo`` as a user runs it: a real process running the whole embedded default
(metadata-sim, controller with the local provider, real agents, real CRIU, file:// store).

One run must end with the proof and the timeline (exit 0); a run with one link broken on
purpose must exit non-zero naming that link; and no run may leave a process behind — not on
success, not on failure, not on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.criu

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))
SMALL = ["--steps", "120", "--step-seconds", "0.05", "--mb", "8", "--notice-at", "12"]


def demo(
    criu: str, workdir: Path, *args: str, timeout: float = 120, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPOTGUARD_CRIU": criu, **env_extra}
    return subprocess.run(
        [SPOTGUARD, "demo", "--workdir", str(workdir), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def leftovers(workdir: Path) -> list[str]:
    """Processes that still belong to the run: working in, or naming, its work dir."""
    found = []
    needle = str(workdir)
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            cwd = p.info["cwd"] or ""
        except psutil.Error:
            continue
        if p.pid != os.getpid() and (needle in cmd or cwd.startswith(needle)):
            found.append(f"{p.pid}: {cmd}")
    return found


def test_demo_proves_continuation_and_prints_the_timeline(criu_bin: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = demo(criu_bin, run, *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    proof = [line for line in out.splitlines() if line.startswith("PROOF")]
    assert proof, out
    assert "identical to the uninterrupted run" in proof[0]
    assert "on VM 2" in proof[0]
    for row in ("notice injected", "frozen", "durable", "relaunched", "restored"):
        assert row in out, f"timeline row {row!r} missing:\n{out}"
    # Line-per-event progress when stdout is not a terminal.
    assert "[" in out.splitlines()[0] and "embedded default up" in out.splitlines()[0]
    assert not run.exists(), "a passing run without --keep removes its work dir"
    assert leftovers(run) == []
    # Issue 28.5, the lines of the same run in the order things happen, without noise:
    # "VM 2 launched" never comes before "waiting for the controller to launch VM 2" (a wait
    # already over is not announced), no "0.0 MiB in the store (0.0 MiB/s)" line, and no
    # line (the timeline table's included) ends in spaces.
    lines = out.splitlines()
    assert any("timeline" in ln for ln in lines), out
    launched = [i for i, ln in enumerate(lines) if "VM 2 launched" in ln]
    waiting = [i for i, ln in enumerate(lines) if "waiting for the controller to launch" in ln]
    assert launched, out
    assert not waiting or waiting[0] < launched[0], out
    assert not [ln for ln in lines if " 0.0 MiB" in ln or "(0.0 MiB/s)" in ln], out
    assert [ln for ln in lines if ln != ln.rstrip()] == [], out


def test_demo_json_summary_on_gcp_with_the_timeline_in_order(criu_bin: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Images are streamed by default; this run takes the staging path (stream = off).
    r = demo(criu_bin, run, *SMALL, "--cloud", "gcp", "--json", "--keep", SPOTGUARD_STREAM="off")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert summary["ok"] is True and summary["reason"] is None
    assert summary["scenario"]["cloud"] == "gcp"
    rows = {row["step"]: row["at"] for row in summary["timeline"]}
    order = [
        rows["notice injected"],
        rows["frozen (state in host memory)"],
        rows["durable (manifest in store)"],
        rows["relaunched (VM 2 running)"],
        rows["restored (job running on VM 2)"],
    ]
    assert None not in order and order == sorted(order), summary["timeline"]
    image = summary["image"]
    assert summary["image_url"].startswith(f"file://{run}/store/train/images/")
    assert image["totals"]["bytes"] > 8 * 1024 * 1024
    assert image["verified_chunks"] == image["totals"]["unique_chunks"]
    # The kept work dir holds what the run describes: the image's manifest, both VMs' logs.
    image_id = summary["image_url"].rsplit("/", 1)[1]
    assert (run / "store" / "train" / "images" / image_id / "manifest.json").is_file()
    manifest = json.loads((run / "store/train/images" / image_id / "manifest.json").read_text())
    assert "stream" not in manifest["meta"] and manifest["meta"]["staging"]["mode"] != "stream"
    assert (run / "vm1" / "agent.log").is_file()
    assert any((run / "local" / "vms").glob("*/agent.log"))
    assert "embedded default up" in r.stderr  # progress goes to stderr with --json
    assert leftovers(run) == []


@pytest.mark.parametrize(
    ("fault", "step", "says"),
    [
        ("launch", "relaunch", "no-such-agent"),
        ("store", "protect", "Not a directory"),  # the agent refuses to start on it
        ("restore", "restore", "is not an executable"),
    ],
)
def test_a_broken_link_fails_loudly_and_leaves_nothing_running(
    criu_bin: str, tmp_path: Path, fault: str, step: str, says: str
) -> None:
    run = tmp_path / "run"
    r = demo(criu_bin, run, *SMALL, "--fault", fault)
    assert r.returncode == 1, r.stdout + r.stderr
    failed = [line for line in r.stdout.splitlines() if "demo FAILED" in line]
    assert failed, r.stdout
    assert f"demo FAILED at {step}:" in failed[0]
    assert says in r.stdout
    # a sentence, not a Python dict of the agent's report nor an error type's name
    assert "{'" not in failed[0] and "Error:" not in failed[0], failed[0]
    assert "PROOF" not in r.stdout
    assert "work dir kept for inspection" in r.stdout
    assert leftovers(run) == []


def test_a_notice_source_fault_is_named(criu_bin: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    r = demo(criu_bin, run, *SMALL, "--fault", "notices", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    assert summary["ok"] is False and summary["failed_step"] == "notice"
    assert "HTTP 503" in summary["reason"]
    assert "demo FAILED at notice" in r.stderr
    assert leftovers(run) == []


def test_impossible_combination_is_refused_before_anything_starts(
    criu_bin: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    r = demo(criu_bin, run, "--cloud", "gcp", "--kind", "rebalance")
    assert r.returncode == 2
    assert "gcp sends no 'rebalance' notices" in r.stderr
    assert "Traceback" not in r.stderr
    assert not run.exists()


def test_ctrl_c_mid_run_stops_every_process(criu_bin: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "SPOTGUARD_CRIU": criu_bin}
    proc = subprocess.Popen(
        [
            SPOTGUARD,
            "demo",
            "--workdir",
            str(run),
            "--steps",
            "400",
            "--step-seconds",
            "0.05",
            "--mb",
            "8",
            "--notice-at",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # a runner started in the background without job control ignores SIGINT, and the
        # demo would inherit that: Ctrl-C is what this test sends, so give it back
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "waiting for the job to reach step" in line:
            break
    assert leftovers(run), "the run should have started its agent and job by now"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + err
    assert "interrupted" in err
    assert leftovers(run) == []
