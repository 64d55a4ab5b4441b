"""Issue 17.3: ``terraform output controller_config`` of each module, rendered from the
module's own template (by ``terraform console``, with the values tfparse resolves), is a whole
controller file that the controller's settings classes read. Starting the controller and an
agent from the rendered files, as the unit and the docs say (listen as rendered, TLS through
the unit's credentials), is tests/infra/test_infra_deploy_host.py."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from spotguard import config
from spotguard.controller.settings import ControllerSettings
from spotguard.image.keys import ImageKeys
from spotguard.image.settings import ImageSettings
from spotguard.notices.fleet import FleetSettings
from spotguard.providers.aws import AwsSettings
from spotguard.providers.gcp import GcpSettings

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "packaging" / "systemd"
AWS_MODULE = ROOT / "terraform" / "aws" / "modules" / "spotguard"
AWS_EXAMPLE = ROOT / "terraform" / "aws" / "examples" / "basic"
GCP_MODULE = ROOT / "terraform" / "gcp" / "modules" / "spotguard"
UID = 65534  # the unit's DynamicUser stands for an unprivileged uid like this one


def unit(name: str) -> dict[str, list[str]]:
    """The ``[Service]`` settings of a unit file: key → every value, in order."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


SIGNING_SOURCE = "aws-secretsmanager:arn:aws:secretsmanager:us-east-1:1:secret:d/image-signing-key"
VERIFY_SOURCE = "aws-ssm:arn:aws:ssm:us-east-1:1:parameter/d/image-verify-key"
VERIFY_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGb1IIvvW8ulwoXzU3UiERCgDu1b8gmmDq2hIRcDXT8y"
VERIFY_KEY_2 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ3kL6x8cG0hVq3H1pyrKa0q9i0w7a1GJb0M8e6V9nM2"


def render_template(tmp: Path, module: Path, tvars: dict[str, Any]) -> str:
    """``templatefile`` of the module's controller template with ``tvars`` (by ``terraform
    console``), after checking that the module's outputs.tf passes every one of them."""
    outputs = (module / "outputs.tf").read_text()
    assert 'templatefile("${path.module}/templates/controller.toml.tftpl"' in outputs
    for key in tvars:
        assert f"    {key} " in outputs, f"outputs.tf passes no {key}"
    tpl = module / "templates" / "controller.toml.tftpl"
    expr = (
        f"base64encode(templatefile({json.dumps(str(tpl))}, "
        f"jsondecode({json.dumps(json.dumps(tvars))})))"
    )
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.fail("terraform is not installed")
    out = subprocess.run(
        [terraform, "console"], input=expr, cwd=tmp, capture_output=True, text=True, check=True
    )
    return base64.b64decode(out.stdout.strip().strip('"')).decode()


def read_as_the_controller(
    tmp: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> config.ConfigFile:
    """``text`` as the controller reads its config file, with no SPOTGUARD_* variable to
    help it (unknown sections or keys would be refused here)."""
    path = tmp / "spotguard.toml"
    path.write_text(text)
    for var in list(os.environ):
        if var.startswith("SPOTGUARD_"):
            monkeypatch.delenv(var)
    return config.ConfigFile.read(path)


def render_controller_config(tmp: Path, queue_url: str, region: str) -> str:
    """The module's ``controller_config`` output: its own template, its own arguments (from
    outputs.tf), the values tfparse resolves for the example and the queue's apply-time URL."""
    from tfparse import load_from_path

    example = dict(load_from_path(str(AWS_EXAMPLE)))
    (module,) = example["module"]
    controller_url = "https://controller.internal.example:9900"
    tvars = {
        "listen": "0.0.0.0:8700",
        "advertise_url": controller_url,
        "store_url": f"s3://{module['name']}-images-123456789012-{region}",
        "token_path": "/etc/spotguard/controller-token",
        "tls": True,
        "credentials_dir": "/run/credentials/spotguard-controller.service",
        "queue_url": queue_url,
        "region": region,
        "launch_template": f"{module['name']}-{{job}}",
        "signing_key_sources": {"train-llm": SIGNING_SOURCE, "eval": SIGNING_SOURCE + "-eval"},
        "verify_key_sources": {"train-llm": VERIFY_SOURCE, "eval": VERIFY_SOURCE + "-eval"},
        "verify_key": f"job=train-llm {VERIFY_KEY}\njob=eval {VERIFY_KEY_2}",
        "subnets": {"us-east-1a": "subnet-0123456789abcdef0"},
    }
    return render_template(tmp, AWS_MODULE, tvars)


def test_controller_config_output_holds_every_section_the_controller_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = render_controller_config(
        tmp_path, "https://sqs.us-east-1.amazonaws.com/1/q", "us-east-1"
    )
    data = tomllib.loads(text)
    assert set(data) == {"controller", "fleet", "aws", "image"}
    cfg = read_as_the_controller(tmp_path, text, monkeypatch)
    controller = config.load(ControllerSettings, config_file=cfg)
    assert controller.provider == "aws", "the controller must not fall back to provider=local"
    assert controller.default_store == "s3://spotguard-demo-images-123456789012-us-east-1"
    assert controller.advertise_url == "https://controller.internal.example:9900"
    assert controller.controller_token_file == Path("/etc/spotguard/controller-token")
    assert config.load(FleetSettings, config_file=cfg).queue_url.endswith("/q")  # type: ignore[union-attr]
    aws = config.load(AwsSettings, config_file=cfg)
    assert aws.aws_regions == ["us-east-1"] and aws.aws_launch_template == "spotguard-demo-{job}"
    assert aws.aws_subnets == {"us-east-1a": "subnet-0123456789abcdef0"}
    # every VM it launches is told where its own job's keys live (no other job's); it trusts
    # every job's public key, each for its own job only
    for job, suffix in (("train-llm", ""), ("eval", "-eval")):
        got = controller.vm_key_sources(job)
        assert got is not None
        assert (got.signing_key, got.verify_key) == (
            SIGNING_SOURCE + suffix,
            VERIFY_SOURCE + suffix,
        )
    assert controller.vm_key_sources("other") is None
    image = config.load(ImageSettings, config_file=cfg)
    keys = ImageKeys.from_settings(image)
    assert keys.required, "the controller must read only signed meta"
    assert sorted(sorted(js) for js in keys.scopes.values()) == [["eval"], ["train-llm"]]


@pytest.mark.parametrize("subnetwork", [None, "regions/us-central1/subnetworks/gpu"])
def test_gcp_controller_config_output_is_a_whole_gcp_controller_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, subnetwork: str | None
) -> None:
    """docs/deploy-gcp.md step 3: ``terraform output controller_config`` of the GCP module is
    the controller's whole file — provider gcp (never a silent provider=local), the bucket,
    the token file, the key sources, the fleet's public key, and where and as whom to launch
    each job's VMs."""
    accounts = {"train-llm": "spotguard-1a2b3c4d5e@my-project.iam.gserviceaccount.com"}
    tvars: dict[str, Any] = {
        "listen": "0.0.0.0:8700",
        "advertise_url": "https://controller.internal.example:9900",
        "store_url": "gs://my-project-spotguard-images",
        "token_path": "/etc/spotguard/controller-token",
        "tls": True,
        "credentials_dir": "/run/credentials/spotguard-controller.service",
        "signing_key_sources": {"train-llm": "gcp-secretmanager:projects/my-project/secrets/k"},
        "verify_key_sources": {"train-llm": "gcp-secretmanager:projects/my-project/secrets/p"},
        "verify_key": f"job=train-llm {VERIFY_KEY}",
        "project": "my-project",
        "zones": ["us-central1-a", "us-central1-b", "us-central1-c"],
        "image": "projects/my-project/global/images/family/spotguard",
        "network": "global/networks/default",
        "subnetwork": subnetwork,
        "disk_gb": 200,
        "termination_action": "DELETE",
        "job_accounts": accounts,
    }
    text = render_template(tmp_path, GCP_MODULE, tvars)
    assert set(tomllib.loads(text)) == {"controller", "image", "gcp"}
    cfg = read_as_the_controller(tmp_path, text, monkeypatch)
    controller = config.load(ControllerSettings, config_file=cfg)
    assert controller.provider == "gcp", "the controller must not fall back to provider=local"
    assert controller.default_store == "gs://my-project-spotguard-images"
    assert controller.controller_token_file == Path("/etc/spotguard/controller-token")
    got = controller.vm_key_sources("train-llm")
    assert got is not None and got.verify_key == "gcp-secretmanager:projects/my-project/secrets/p"
    gcp = config.load(GcpSettings, config_file=cfg)
    assert (gcp.gcp_project, gcp.gcp_zones) == ("my-project", tvars["zones"])
    assert gcp.gcp_image == tvars["image"] and gcp.gcp_disk_gb == 200
    assert gcp.gcp_subnetwork == subnetwork
    assert gcp.gcp_job_service_accounts == accounts
    assert ImageKeys.from_settings(config.load(ImageSettings, config_file=cfg)).required


def test_the_agent_unit_keeps_its_state_in_its_state_directory() -> None:
    svc: dict[str, Any] = unit("spotguard-agent.service")
    env = dict(v.partition("=")[::2] for v in svc["Environment"])
    (state_name,) = svc["StateDirectory"]
    assert env["SPOTGUARD_STATE_DIR"] == f"/var/lib/{state_name}"
    assert "DynamicUser" not in svc and "User" not in svc, "CRIU needs root"
