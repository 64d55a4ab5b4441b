"""The commands, as users run them: metadata-sim as a process, notice send/list/cancel, and
notices watch printing JSON lines until Ctrl-C."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator

import pytest

from sgtest import sg, without_spotguard_settings


def _sim(url: str) -> dict[str, str]:
    """The settings that point every cloud's metadata client at the simulator at ``url``."""
    return {
        "SPOTGUARD_SIM_URL": url,
        "AWS_EC2_METADATA_SERVICE_ENDPOINT": url + "/",
        "GCE_METADATA_HOST": url.removeprefix("http://"),
        "SPOTGUARD_AZURE_METADATA_ENDPOINT": url,
    }


@pytest.fixture
def sim_process() -> Iterator[str]:
    """``spotguard metadata-sim --port 0`` as a process; yields its URL."""
    proc = subprocess.Popen(
        ["spotguard", "metadata-sim", "--port", "0", "--instance-type", "a2-highgpu-1g"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", first)
        assert match, first + (proc.stderr.read() if proc.stderr else "")
        yield match.group(0)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 0, err
        assert "Traceback" not in err


def _run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return sg(*args, env=_sim(url), timeout=30)


def test_notice_send_list_cancel(sim_process: str) -> None:
    sent = _run(sim_process, "notice", "send", "--cloud", "aws", "--kind", "preempt", "--in", "90")
    assert sent.returncode == 0, sent.stderr
    notice_id = sent.stdout.strip()
    listed = _run(sim_process, "notice", "list", "--json")
    [item] = json.loads(listed.stdout)
    assert (item["id"], item["action"], item["state"]) == (notice_id, "terminate", "active")
    assert _run(sim_process, "notice", "cancel", notice_id).returncode == 0
    [item] = json.loads(_run(sim_process, "notice", "list", "--json").stdout)
    assert item["state"] == "cancelled"
    facts = json.loads(_run(sim_process, "notices", "facts", "--cloud", "aws").stdout)
    assert facts["instance_type"] == "a2-highgpu-1g"


def test_bad_input_is_one_line_not_a_traceback(sim_process: str) -> None:
    bad = _run(sim_process, "notice", "send", "--cloud", "gcp", "--kind", "rebalance")
    assert bad.returncode != 0
    assert "gcp has no 'rebalance' notices" in bad.stderr
    assert "Traceback" not in bad.stderr
    gone = _run(sim_process, "notice", "cancel", "no-such-id")
    assert gone.returncode != 0 and "no notice" in gone.stderr


def test_watch_prints_json_lines_and_stops_on_ctrl_c(sim_process: str) -> None:
    watch = subprocess.Popen(
        [
            "spotguard",
            "notices",
            "watch",
            "--cloud",
            "gcp",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=without_spotguard_settings(**_sim(sim_process)),
    )
    try:
        assert watch.stderr is not None and watch.stdout is not None
        assert "watching gcp" in watch.stderr.readline()
        sent = _run(sim_process, "notice", "send", "--cloud", "gcp", "--kind", "preempt")
        assert sent.returncode == 0, sent.stderr
        line = json.loads(watch.stdout.readline())
        assert {k: line[k] for k in ("cloud", "kind", "cancelled")} == {
            "cloud": "gcp",
            "kind": "preempt",
            "cancelled": False,
        }
        assert line["id"] and line["deadline"].endswith("Z")
        _run(sim_process, "notice", "cancel", sent.stdout.strip())
        assert json.loads(watch.stdout.readline())["cancelled"] is True
    finally:
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=10)
    assert watch.returncode == 0, err
    assert "Traceback" not in err


def test_watch_without_any_metadata_service_says_so(closed_url: str) -> None:
    out = _run(closed_url, "notices", "watch", "--detect-timeout", "0.2")
    assert out.returncode == 1
    assert "no cloud metadata service answered" in out.stderr
    assert "Traceback" not in out.stderr
