"""A park to a store is reported to the controller through the private-network mode too:
plain http to a controller off this host, allowed by the operator's ``insecure_controller``
(the agent's setting or the node's assignment), as the agent's own reports are."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from spotguard.agent.settings import AgentSettings
from spotguard.contracts import ASSIGNMENT_ENV
from spotguard.park import report
from spotguard.park.record import ParkRecord
from spotguard.statedir import StateDir


def _private_url() -> str:
    """http:// to this host's own non-loopback address, on a port nothing listens on (the
    report waits in the outbox): a controller on the private network, down for now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: picks the outgoing address
        ip = s.getsockname()[0]
    if ip.startswith("127."):
        pytest.skip("this host has no address off loopback")
    with socket.socket() as s:
        s.bind((ip, 0))
        port = s.getsockname()[1]
    return f"http://{ip}:{port}"


def _record() -> ParkRecord:
    return ParkRecord(job="train", place="store", location="file:///tmp/store/train/images/x")


async def test_a_store_park_is_queued_for_an_insecure_private_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(report, "REPORT_WAIT_S", 0.3)
    monkeypatch.delenv(ASSIGNMENT_ENV, raising=False)
    settings = AgentSettings(
        controller_url=_private_url(), insecure_controller=True, assignment=tmp_path / "none.json"
    )
    assert await report.report_parked(_record(), settings, tmp_path / "state") == "queued"
    assert any(StateDir(tmp_path / "state").outbox.iterdir())  # the agent sends it later


async def test_without_the_opt_in_a_plain_http_controller_is_not_used(tmp_path: Path) -> None:
    settings = AgentSettings(assignment=tmp_path / "none.json")
    object.__setattr__(settings, "controller_url", _private_url())  # as an old config would hold it
    assert await report.report_parked(_record(), settings, tmp_path / "state") is None
