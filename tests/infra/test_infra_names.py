"""Issue 28.2: one source of truth for paths, ports and versions. The code's constants (the
config path, the state dir, the assignment path, the controller's port, the minimum CRIU, the
agent's metrics and their labels) against the README, docs/*, the systemd units, both
Terraform modules' ``local.spotguard``, the Packer template and ``--help``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import hcl2
import pytest

from spotguard.agent.metrics import JOB_LABEL, METRICS, AgentMetrics
from spotguard.checkpoint.criu import MIN_VERSION_TEXT
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.config import DEFAULT_CONFIG_PATHS
from spotguard.contracts import ASSIGNMENT_PATH
from spotguard.controller.settings import ControllerSettings

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "packaging" / "systemd"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEPLOY = [
    ROOT / "README.md",
    ROOT / "docs" / "deploy-aws.md",
    ROOT / "docs" / "deploy-gcp.md",
    ROOT / "packaging" / "spotguard.toml.example",
]
CONFIG = str(DEFAULT_CONFIG_PATHS[0])
STATE = str(CheckpointSettings.model_fields["state_dir"].default)
TOKEN = "/etc/spotguard/controller-token"
PORT = ControllerSettings.model_fields["listen"].default.rpartition(":")[2]


def locals_of(cloud: str) -> dict[str, Any]:
    with (ROOT / "terraform" / cloud / "modules" / "spotguard" / "main.tf").open() as f:
        doc = hcl2.load(f)
    for block in doc["locals"]:
        if "spotguard" in block:
            value = block["spotguard"]
            return dict(value[0] if isinstance(value, list) else value)
    raise AssertionError(f"no local.spotguard in the {cloud} module")


def unit_text(name: str) -> str:
    return (UNITS / name).read_text()


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_terraform_names_are_the_codes_and_the_units(cloud: str) -> None:
    names = locals_of(cloud)
    assert names["config_path"] == CONFIG
    assert names["state_dir"] == STATE
    assert names["assignment_path"] == ASSIGNMENT_PATH
    assert names["token_path"] == TOKEN
    controller = unit_text("spotguard-controller.service")
    assert f"LoadCredential=controller-token:{names['token_path']}" in controller
    assert f"LoadCredential=spotguard.toml:{names['config_path']}" in controller
    assert f"LoadCredential=controller.crt:{names['tls_cert_path']}" in controller
    assert f"LoadCredential=controller.key:{names['tls_key_path']}" in controller
    assert names["credentials_dir"] == "/run/credentials/spotguard-controller.service"
    agent = unit_text("spotguard-agent.service")
    assert f"ConditionPathExists=|{names['config_path']}" in agent
    assert f"Environment=SPOTGUARD_STATE_DIR={names['state_dir']}" in agent
    assert f"Environment=SPOTGUARD_ASSIGNMENT={ASSIGNMENT_PATH}" in agent
    variables = (ROOT / "terraform" / cloud / "modules" / "spotguard" / "variables.tf").read_text()
    assert f'default     = "0.0.0.0:{PORT}"' in variables, "controller_listen's port"


def test_docs_name_the_token_file_and_the_port_the_code_and_units_use() -> None:
    for doc in DEPLOY:
        text = doc.read_text()
        assert "controller.token" not in text, f"{doc.name}: the token file is {TOKEN}"
        for url in re.findall(r"https?://[\w.-]+:(\d+)", text):
            assert url == PORT, f"{doc.name}: a controller URL on port {url}, not {PORT}"
        assert TOKEN in text, doc.name
    for tf in (ROOT / "terraform").rglob("*.tf"):
        for port in re.findall(r"https?://controller[\w.-]*:(\d+)", tf.read_text()):
            assert port == PORT, f"{tf}: controller URL on port {port}"


def test_docs_and_help_name_the_criu_the_code_needs() -> None:
    for doc in DOCS:
        for found in re.findall(r"CRIU (?:≥|>=) ?(\d+(?:\.\d+)*)", doc.read_text()):
            assert found == MIN_VERSION_TEXT, f"{doc.name}: CRIU >= {found}"
    out = subprocess.run(
        [sys.executable, "-m", "spotguard", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert f"CRIU >= {MIN_VERSION_TEXT}" in " ".join(out.split())
    out = subprocess.run(
        [sys.executable, "-m", "spotguard", "install-criu", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.findall(r"criu >= ([\d.]+)", " ".join(out.split()), re.I) == [MIN_VERSION_TEXT] * 2
    for found in re.findall(r"CRIU >= ([\d.]+)", (ROOT / "pyproject.toml").read_text()):
        assert found == MIN_VERSION_TEXT


def test_deploy_docs_state_the_packer_driver_default() -> None:
    with (ROOT / "ami" / "spotguard.pkr.hcl").open() as f:
        doc = hcl2.load(f)
    (branch,) = [v["nvidia_driver_branch"] for v in doc["variable"] if "nvidia_driver_branch" in v]
    default = (branch[0] if isinstance(branch, list) else branch)["default"]
    default = default[0] if isinstance(default, list) else default
    text = " ".join((ROOT / "docs" / "deploy-aws.md").read_text().split())
    assert f"`nvidia_driver_branch`, default {default}" in text


def test_readme_does_not_ask_gpu_jobs_for_no_pid_namespace() -> None:
    text = (ROOT / "README.md").read_text()
    assert "--no-pid-namespace" not in text, "GPU jobs run in their own PID namespace"


def test_agent_md_names_only_metrics_and_labels_that_exist() -> None:
    m = AgentMetrics()
    labels: dict[str, set[str]] = {}
    for obj in vars(m).values():
        name = getattr(obj, "_name", None)
        if name:
            labels[name] = set(getattr(obj, "_labelnames", ()))
    text = (ROOT / "docs" / "agent.md").read_text()
    table = text[text.index("| metric | labels | meaning |") :]
    rows = re.findall(r"^\| `(spotguard_\w+)` \| ([^|]*) \|", table, re.M)
    assert rows
    for metric, cells in rows:
        assert metric in METRICS or metric in labels, f"docs/agent.md names {metric}"
        base = metric.removesuffix("_total")
        named = {c.strip() for c in cells.split(",") if c.strip() not in ("—", "")}
        if base in labels or metric in labels:  # (collected families have no label list)
            assert named == labels.get(base, labels.get(metric, set())), (metric, named)
        assert "job" not in named, f"the job label is {JOB_LABEL}"


def test_units_documentation_points_at_files_of_this_repository() -> None:
    for unit in UNITS.glob("*.service"):
        for url in re.findall(r"^Documentation=(\S+)", unit.read_text(), re.M):
            assert not url.startswith("file://"), f"{unit.name}: {url} is not installed"
            path = url.split("/blob/main/", 1)[1]
            assert (ROOT / path).is_file(), f"{unit.name}: {path}"
