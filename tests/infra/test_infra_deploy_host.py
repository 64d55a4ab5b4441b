"""Issue 28.1 / 28.4: docs/deploy-aws.md followed as written reaches a running controller and
agent — from the module's own rendered templates, with ``listen = "0.0.0.0:8700"`` as rendered
(never rewritten), TLS through the unit's credentials (or the private-network mode), and a
per-job VM token issued by ``spotguard controller --issue-token`` in the first-boot user-data
(never the admin token). The host is tests/infra/deploy_host.py inside its own mount, network
and PID namespaces (overlays on /etc and /var/lib, loopback only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

HOST = Path(__file__).with_name("deploy_host.py")


def deploy(tmp_path: Path, mode: str, cloud: str = "aws") -> dict[str, Any]:
    if os.geteuid() != 0:
        pytest.skip("needs root (namespaces, overlays, CRIU)")
    for tool in ("unshare", "setpriv", "ip", "openssl", "terraform"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed")
    tmp_path.chmod(0o755)
    cmd = ["unshare", "-m", "-n", "-p", "-f", "--mount-proc", "--propagation", "private"]
    proc = subprocess.run(
        [*cmd, sys.executable, str(HOST), str(tmp_path), mode, cloud],
        capture_output=True,
        text=True,
        timeout=240,
    )
    report_file = tmp_path / "report.json"
    assert report_file.is_file(), proc.stdout + proc.stderr
    report: dict[str, Any] = json.loads(report_file.read_text())
    assert "error" not in report, json.dumps(report, indent=2)[-8000:]
    return report


def log_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("mode", ["tls", "private"])
def test_the_documented_aws_deploy_runs_a_controller_and_an_agent(
    tmp_path: Path, mode: str
) -> None:
    report = deploy(tmp_path, mode)
    config = tomllib.loads(report["controller_config"])["controller"]
    assert config["listen"] == "0.0.0.0:8700"
    if mode == "tls":
        assert config["tls_cert_file"].startswith("/run/credentials/spotguard-controller.service/")
        assert "insecure_listen" not in config
    else:
        assert config["insecure_listen"] is True and "tls_cert_file" not in config
    ctl = log_lines(report["controller_log"])
    (listening,) = [r for r in ctl if r.get("msg") == "controller listening"]
    scheme = "https" if mode == "tls" else "http"
    assert listening["url"] == f"{scheme}://0.0.0.0:8700", listening

    # the VM holds its own job's token, and nothing of the admin token
    token = report["token"]
    assert token.startswith("sgvm1.train-llm.0."), token
    assert report["token_file"] == token
    assert "admin-token-never-on-a-vm" not in report["user_data"]
    assert "enable --now spotguard-agent.service" in report["systemctl"]

    # the agent protects the job the first boot started with `spotguard run`
    jobs = {j["job"]: j for j in report["status"].get("jobs", [])}
    assert "train-llm" in jobs, json.dumps(report, indent=1)[-6000:]
    assert jobs["train-llm"]["state"] == "protecting", report["status"]
    # private mode: the controller's network address (not loopback), by the agent's opt-in
    host = "127.0.0.1" if mode == "tls" else "10.88.0.1"
    assert report["url"] == f"{scheme}://{host}:8700"
    assert report["status"]["agent"]["controller"] == f"{report['url']}/v1/events"
    agent = tomllib.loads(report["agent_config"])["agent"]
    assert agent.get("insecure_controller", False) is (mode == "private"), agent

    # the controller heard the agent (its VM token, over HTTPS in TLS mode): a checkpoint
    # after the rebalance notice, its image recorded
    job = report["job"]
    assert job.get("name") == "train-llm", json.dumps(report, indent=1)[-6000:]
    assert (job.get("image_url") or "").startswith("s3://"), json.dumps(report, indent=1)[-6000:]
    assert job["state"] == "protected" and job["owner"]["epoch"] == 0, job
    errors = [r for r in ctl if r.get("level") == "error"]
    assert not errors, json.dumps(errors, indent=1)[-3000:]


@pytest.mark.parametrize("mode", ["tls", "private"])
def test_the_documented_gcp_deploy_starts_the_controller_and_the_first_boot(
    tmp_path: Path, mode: str
) -> None:
    """docs/deploy-gcp.md: the GCP module's controller_config (provider gcp, listen as
    rendered) starts the controller as its unit says, and its first-boot startup script
    writes the agent's config and its job's own token (its agent needs GCE and GCS: not
    started here)."""
    report = deploy(tmp_path, mode, "gcp")
    config = tomllib.loads(report["controller_config"])["controller"]
    assert config["provider"] == "gcp" and config["listen"] == "0.0.0.0:8700"
    assert ("tls_cert_file" in config) is (mode == "tls"), config
    ctl = log_lines(report["controller_log"])
    (listening,) = [r for r in ctl if r.get("msg") == "controller listening"]
    scheme = "https" if mode == "tls" else "http"
    assert listening["url"] == f"{scheme}://0.0.0.0:8700", listening
    assert report["jobs"] == {"jobs": []}, report["jobs"]
    token = report["token"]
    assert token.startswith("sgvm1.train-llm.0.") and report["token_file"] == token
    assert "admin-token-never-on-a-vm" not in report["user_data"]
    agent = tomllib.loads(report["agent_config"])
    assert agent["notices"]["cloud"] == "gcp" and agent["agent"]["store"].startswith("gs://")
    assert agent["agent"]["controller_url"] == report["url"]
    assert agent["agent"].get("insecure_controller", False) is (mode == "private"), agent
    assert "enable --now spotguard-agent.service" in report["systemctl"]
    errors = [r for r in ctl if r.get("level") == "error"]
    assert not errors, json.dumps(errors, indent=1)[-3000:]
