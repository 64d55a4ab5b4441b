"""Shared fixtures. Every test talks to real processes and real local servers."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_CRIU = os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1"
MIN_TESTS = 1


def pytest_configure(config: pytest.Config) -> None:
    """Tests run the console scripts installed beside this interpreter (``spotguard``,
    ``checkov``, ``shellcheck``), whether or not the virtualenv is activated."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path


def pytest_collection_finish(session: pytest.Session) -> None:
    """Never let "nothing collected" pass: an empty selection is a failure."""
    if len(session.items) < MIN_TESTS and not session.config.option.collectonly:
        raise pytest.UsageError("no tests collected: refusing to report success")


def find_criu() -> str | None:
    """A CRIU new enough for spotguard (the same minimum as spotguard.checkpoint.criu), as
    scripts/install-criu installs it."""
    from spotguard.checkpoint.criu import version_ok

    for cand in (
        os.environ.get("SPOTGUARD_CRIU"),
        "/opt/spotguard/criu/bin/criu",
        shutil.which("criu"),
    ):
        if cand and os.access(cand, os.X_OK):
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            version = re.search(r"^Version:\s*(\S+)", out, re.MULTILINE)
            if version_ok(version.group(1) if version else None):
                return cand
    return None


@pytest.fixture(scope="session")
def criu_bin() -> str:
    """Path of CRIU; skips (or fails in CI, where SPOTGUARD_REQUIRE_CRIU=1) when absent."""
    path = find_criu()
    if path is None or os.geteuid() != 0:
        msg = "needs root and CRIU >= 4.2.1 (run scripts/install-criu)"
        if REQUIRE_CRIU:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real moto server (S3, EC2, SQS, EventBridge, DynamoDB) on a free loopback port.

    Yields its endpoint URL. Tests point boto3 at it with ``endpoint_url`` or the standard
    ``AWS_ENDPOINT_URL`` variable; credentials are dummies set by :func:`aws_env`.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Environment that sends every boto3 client to the moto server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_server
