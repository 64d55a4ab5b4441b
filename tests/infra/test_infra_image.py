"""Static checks of the machine image (Packer template, provisioning scripts), the systemd
units, the example config and the first-boot scripts the Terraform modules render. Packer is
not available here: its template is parsed with python-hcl2 and its references followed."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import hcl2
import pytest

from spotguard import config
from spotguard.agent.settings import AgentSettings
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import ASSIGNMENT_PATH, Assignment
from spotguard.image.delivery import SIGNING_NAME, VERIFY_NAME, KeysSettings
from spotguard.image.settings import ImageSettings
from spotguard.notices.fleet import FleetSettings
from spotguard.notices.settings import NoticeSettings

ROOT = Path(__file__).resolve().parents[2]
AMI = ROOT / "ami"
UNITS = ROOT / "packaging" / "systemd"
SCRIPTS = sorted((AMI / "scripts").glob("*.sh"))
MODULES = {
    "aws": ROOT / "terraform" / "aws" / "modules" / "spotguard",
    "gcp": ROOT / "terraform" / "gcp" / "modules" / "spotguard",
}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (pip install -e '.[dev]' provides shellcheck)")
    return path


def flat(value: Any) -> Any:
    """python-hcl2 wraps attribute values and blocks in one-element lists: unwrap them."""
    if isinstance(value, list):
        items = [flat(v) for v in value]
        return items[0] if len(items) == 1 else items
    if isinstance(value, dict):
        return {k: flat(v) for k, v in value.items()}
    return value


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def lint_shell(path: Path) -> None:
    subprocess.run(["bash", "-n", str(path)], check=True)
    out = subprocess.run([tool("shellcheck"), "-x", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.fixture(scope="module")
def packer() -> dict[str, Any]:
    with (AMI / "spotguard.pkr.hcl").open() as f:
        doc = {k: as_list(flat(v)) for k, v in hcl2.load(f).items()}
    return doc


def test_packer_builds_for_aws_and_gcp(packer: dict[str, Any]) -> None:
    sources = {
        (t, n): body
        for item in packer["source"]
        for t, named in item.items()
        for n, body in named.items()
    }
    assert set(sources) == {("amazon-ebs", "gpu"), ("googlecompute", "gpu")}
    ebs = sources[("amazon-ebs", "gpu")]
    assert ebs["encrypt_boot"] is True
    assert ebs["metadata_options"]["http_tokens"] == "required"
    assert all(d["encrypted"] is True for d in as_list(ebs["launch_block_device_mappings"]))
    gce = sources[("googlecompute", "gpu")]
    assert gce["enable_secure_boot"] is True
    (build,) = packer["build"]
    assert sorted(build["sources"]) == ["source.amazon-ebs.gpu", "source.googlecompute.gpu"]


def test_packer_variables_promise_driver_580_and_a_valid_thp_mode(packer: dict[str, Any]) -> None:
    variables = {n: b for item in packer["variable"] for n, b in item.items()}
    # 580+: the first branch whose restore remaps GPUs (every cross-VM restore does)
    assert int(variables["nvidia_driver_branch"]["default"]) >= 580
    assert variables["thp_mode"]["default"] in ("always", "madvise")
    for name, body in variables.items():
        assert body.get("description"), name


def test_packer_provisioners_reference_existing_files(packer: dict[str, Any]) -> None:
    (build,) = packer["build"]
    paths: list[str] = []
    for prov in build["provisioner"]:
        for kind, body in prov.items():
            if kind == "file":
                paths += as_list(body["sources"])
            if kind == "shell":
                paths += as_list(body.get("scripts", []))
    resolved = [p.replace("${path.root}", str(AMI)) for p in paths if p != "${var.wheel}"]
    assert len(resolved) >= 10
    for p in resolved:
        assert Path(p).is_file(), p
    scripts = {Path(p).name for p in resolved if p.endswith(".sh")}
    assert scripts == {p.name for p in SCRIPTS}, "every script runs, and only those"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_provisioning_script_passes_shellcheck(script: Path) -> None:
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    lint_shell(script)


# ----- first-boot scripts rendered by terraform itself -------------------------------------


def module_paths(cloud: str) -> dict[str, str]:
    with (MODULES[cloud] / "main.tf").open() as f:
        doc = hcl2.load(f)
    (loc,) = [b for b in as_list(flat(doc["locals"])) if "spotguard" in b]
    return dict(loc["spotguard"])


def render(cloud: str, tmp: Path, url: str | None, token: str | None, command: str) -> str:
    """``templatefile()`` evaluated by ``terraform console`` (no providers needed)."""
    paths = module_paths(cloud)
    job = "train-llm"
    tvars = {
        "job": job,
        "store_url": f"{'s3' if cloud == 'aws' else 'gs'}://bucket-x",
        "controller_url": url,
        "insecure_controller": False,  # the module: !var.controller_tls (deploy_host: True)
        "job_token": token,
        "command": command,
        "paths": paths,
        "run_command": paths["run_command"] % (job, paths["job_script_path"]),
        "key_sources": KEY_SOURCES[cloud],
    }
    tpl = MODULES[cloud] / "templates" / "first-boot.sh.tftpl"
    args = f"{json.dumps(str(tpl))}, jsondecode({json.dumps(json.dumps(tvars))})"
    expr = f"base64encode(templatefile({args}))"
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not installed")
    out = subprocess.run(
        [terraform, "console"], input=expr, cwd=tmp, capture_output=True, text=True, check=True
    )
    return base64.b64decode(out.stdout.strip().strip('"')).decode()


KEY_SOURCES = {
    "aws": {
        "signing": "aws-secretsmanager:arn:aws:secretsmanager:us-east-1:1:secret:sg/signing-key",
        "verify": "aws-ssm:arn:aws:ssm:us-east-1:1:parameter/sg/image-verify-key",
    },
    "gcp": {
        "signing": "gcp-secretmanager:projects/p/secrets/sg-image-signing-key",
        "verify": "gcp-secretmanager:projects/p/secrets/sg-image-verify-key",
    },
}


def heredoc(script: str, marker: str) -> str:
    m = re.search(rf"<<'{marker}'\n(.*?)\n{marker}\n", script, re.S)
    assert m, f"no {marker} heredoc"
    return m.group(1)


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
@pytest.mark.parametrize("with_controller", [True, False])
def test_first_boot_script_is_valid_and_writes_a_loadable_config(
    cloud: str, with_controller: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = "cd /opt/train && exec python3 train.py --lr '1e-4' \"$EXTRA\""
    url = "https://controller.example:9900" if with_controller else None
    token = "sgvm1.train-llm.0.bWFjLW9mLXRoZS12bS10b2tlbg" if with_controller else None
    script = render(cloud, tmp_path, url, token, command)
    path = tmp_path / "first-boot.sh"
    path.write_text(script)
    lint_shell(path)
    paths = module_paths(cloud)
    assert paths["assignment_path"] == ASSIGNMENT_PATH
    assert f"systemctl enable --now {paths['agent_service']}" in script
    assert heredoc(script, "SPOTGUARD_JOB") == command  # the command reaches the VM verbatim
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(heredoc(script, "SPOTGUARD_CONFIG"))
    tomllib.loads(cfg.read_text())
    for var in ("SPOTGUARD_STORE", "SPOTGUARD_CONTROLLER_URL", "SPOTGUARD_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    agent = config.load(AgentSettings, config_file=cfg)
    assert agent.job == ["train-llm"]
    assert agent.store.endswith("://bucket-x")
    assert agent.controller_url == url
    if with_controller:
        assert agent.controller_token_file == Path(paths["token_path"])
        assert heredoc(script, "SPOTGUARD_TOKEN") == token
    else:
        assert "SPOTGUARD_TOKEN" not in script
    assert config.load(NoticeSettings, config_file=cfg).cloud == cloud
    assert str(config.load(CheckpointSettings, config_file=cfg).state_dir) == paths["state_dir"]
    # Signed images by default: the agent signs with and trusts the fleet's key, which
    # fetch-keys fetches from the sources the config names (never the key itself).
    image = config.load(ImageSettings, config_file=cfg)
    assert image.signing_key_file == Path(paths["signing_key"])
    assert image.verify_key_file == Path(paths["verify_key"])
    keys = config.load(KeysSettings, config_file=cfg)
    assert keys.signing_key_source == KEY_SOURCES[cloud]["signing"]
    assert keys.verify_key_source == KEY_SOURCES[cloud]["verify"]
    assert keys.keys_dir / SIGNING_NAME == image.signing_key_file
    assert keys.keys_dir / VERIFY_NAME == image.verify_key_file
    assert "PRIVATE KEY" not in script and "ssh-ed25519" not in script


# ----- systemd units and the example config -------------------------------------------------


def test_units_agree_with_the_assignment_contract() -> None:
    agent = (UNITS / "spotguard-agent.service").read_text()
    user_data = Assignment(job="j", image_url="s3://b/j/images/1", store="s3://b").user_data()
    (unit,) = re.findall(r"systemctl restart (\S+)", user_data)
    assert (UNITS / unit).is_file()
    assert f"ConditionPathExists=|{ASSIGNMENT_PATH}" in agent
    assert "ExecStart=/usr/local/bin/spotguard agent" in agent
    # the keys are fetched on every start (a relaunched VM's included), before the agent runs
    lines = agent.splitlines()
    pre = lines.index("ExecStartPre=/usr/local/bin/spotguard fetch-keys")
    envf = lines.index(f"EnvironmentFile=-{KeysSettings().keys_env_file}")
    assert pre < envf < lines.index("ExecStart=/usr/local/bin/spotguard agent")
    assert "RuntimeDirectory=spotguard" in lines and "RuntimeDirectoryMode=0700" in lines
    assert "Wants=network-online.target spotguard-doctor.service" in agent
    doctor = (UNITS / "spotguard-doctor.service").read_text()
    assert "ExecStart=/usr/local/bin/spotguard doctor" in doctor
    controller = (UNITS / "spotguard-controller.service").read_text()
    assert "ExecStart=/usr/local/bin/spotguard controller" in controller


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    exe = shutil.which("spotguard")
    assert exe, "spotguard is not installed in this environment"
    units = []
    for src in sorted(UNITS.glob("*.service")):
        dst = tmp_path / src.name
        dst.write_text(src.read_text().replace("/usr/local/bin/spotguard", exe))
        units.append(str(dst))
    out = subprocess.run(
        [analyze, "verify", "--man=no", *units], capture_output=True, text=True, check=False
    )
    problems = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        # Units named in Wants/After that only exist on the image (driver daemon).
        if line.strip() and "nvidia-persistenced" not in line
    ]
    assert out.returncode == 0 and not problems, problems


def test_example_config_loads_with_every_section(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "packaging" / "spotguard.toml.example"
    data = tomllib.loads(path.read_text())
    assert set(data) == {"agent", "notices", "checkpoint", "fleet", "image", "keys"}
    for var in ("SPOTGUARD_STORE", "SPOTGUARD_FLEET_QUEUE_URL", "SPOTGUARD_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    agent = config.load(AgentSettings, config_file=path)
    assert agent.store == data["agent"]["store"]
    assert config.load(FleetSettings, config_file=path).queue_url == data["fleet"]["queue_url"]
    config.load(NoticeSettings, config_file=path)
    config.load(CheckpointSettings, config_file=path)
    for var in ("SPOTGUARD_SIGNING_KEY_FILE", "SPOTGUARD_VERIFY_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    image = config.load(ImageSettings, config_file=path)
    keys = config.load(KeysSettings, config_file=path)
    assert image.signing_key_file == keys.keys_dir / SIGNING_NAME
    assert image.verify_key_file == keys.keys_dir / VERIFY_NAME
    assert keys.signing_key_source and keys.verify_key_source
