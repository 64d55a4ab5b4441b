"""Issue 17.3: docs/deploy-aws.md, followed as written, deploys. ``terraform output
controller_config`` is rendered from the module's own template (by ``terraform console``, with
the values tfparse resolves and a real queue on a local moto server), installed as the docs say
(``/etc/spotguard`` 0700, root-only), and the controller is started with exactly its systemd
unit's settings: the unit's environment, its credentials (``LoadCredential=``, as systemd
copies them), its ``StateDirectory`` and its unprivileged user, running the unit's ExecStart
command line. Only the listen port is moved to a free one. systemd is not PID 1 here, so this
test does what the unit asks of systemd and ``systemd-analyze verify`` (test_infra_image)
checks the unit itself."""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
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
        "queue_url": queue_url,
        "region": region,
        "launch_template": f"{module['name']}-{{job}}",
        "signing_key_source": SIGNING_SOURCE,
        "verify_key_source": VERIFY_SOURCE,
        "verify_key": VERIFY_KEY,
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
    # every VM it launches is told where the fleet's keys live; it trusts the fleet's key itself
    assert controller.vm_signing_key_source == SIGNING_SOURCE
    assert controller.vm_verify_key_source == VERIFY_SOURCE
    image = config.load(ImageSettings, config_file=cfg)
    assert ImageKeys.from_settings(image).required, "the controller must read only signed meta"


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
        "signing_key_source": "gcp-secretmanager:projects/my-project/secrets/k",
        "verify_key_source": "gcp-secretmanager:projects/my-project/secrets/p",
        "verify_key": VERIFY_KEY,
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
    assert controller.vm_verify_key_source == "gcp-secretmanager:projects/my-project/secrets/p"
    gcp = config.load(GcpSettings, config_file=cfg)
    assert (gcp.gcp_project, gcp.gcp_zones) == ("my-project", tvars["zones"])
    assert gcp.gcp_image == tvars["image"] and gcp.gcp_disk_gb == 200
    assert gcp.gcp_subnetwork == subnetwork
    assert gcp.gcp_job_service_accounts == accounts
    assert ImageKeys.from_settings(config.load(ImageSettings, config_file=cfg)).required


@pytest.fixture
def host_root() -> Iterator[Path]:
    """A directory standing for ``/`` that an unprivileged user may traverse."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the controller runs as another user, as its unit says")
    root = Path(tempfile.mkdtemp(prefix="sg-deploy-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_unit_would(svc: dict[str, list[str]], root: Path, name: str) -> tuple[dict[str, str], Path]:
    """What systemd does before ExecStart: credentials copied (0400, the service's user),
    ``%d`` expanded, the StateDirectory created for that user, the environment set."""
    creds = root / "run" / "credentials" / name
    creds.mkdir(parents=True)
    for spec in svc.get("LoadCredential", []):
        cred_id, _, source = spec.partition(":")
        dst = creds / cred_id
        shutil.copyfile(root / source.lstrip("/"), dst)
        os.chown(dst, UID, UID)
        dst.chmod(0o400)
    os.chown(creds, UID, UID)
    creds.chmod(0o500)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    for assignment in svc.get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value.replace("%d", str(creds))
    (state_name,) = svc["StateDirectory"]
    state = root / "var" / "lib" / state_name
    state.mkdir(parents=True)
    os.chown(state, UID, UID)
    state.chmod(0o700)
    assert env["SPOTGUARD_STATE_DIR"] == f"/var/lib/{state_name}", "DB outside StateDirectory"
    env["SPOTGUARD_STATE_DIR"] = str(state)
    return env, state


def test_the_controller_starts_with_exactly_its_units_settings(
    host_root: Path, moto_server: str
) -> None:
    svc = unit("spotguard-controller.service")
    assert svc["DynamicUser"] == ["yes"], "the unit runs unprivileged (this test as uid 65534)"
    region = "us-east-1"
    sqs = boto3.client(
        "sqs",
        endpoint_url=moto_server,
        region_name=region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    queue_url = sqs.create_queue(QueueName="spotguard-demo-events")["QueueUrl"]

    # /etc/spotguard as docs/deploy-aws.md installs it: root-only.
    etc = host_root / "etc" / "spotguard"
    etc.mkdir(parents=True)
    etc.chmod(0o700)
    (etc / "spotguard.toml").write_text(render_controller_config(host_root, queue_url, region))
    (etc / "spotguard.toml").chmod(0o600)
    (etc / "controller-token").write_text("s3cr3t-fleet-token\n")
    (etc / "controller-token").chmod(0o600)

    env, state = _as_unit_would(svc, host_root, "spotguard-controller.service")
    port = _free_port()
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    env |= {
        "SPOTGUARD_LISTEN": f"127.0.0.1:{port}",  # the one change: a free port
        "PYTHONPATH": f"{ROOT / 'src'}:{site}",
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "HOME": str(state),
    }
    (execstart,) = svc["ExecStart"]
    argv = shlex.split(execstart)
    assert argv[0] == "/usr/local/bin/spotguard"
    python = shutil.which("python3", path="/usr/bin")  # root's own interpreter is not
    assert python, "needs /usr/bin/python3"  # readable by other users here
    cmd = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", python, "-m"]
    cmd += ["spotguard", *argv[1:]]
    proc = subprocess.Popen(
        cmd, env=env, cwd=state, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        ok = False
        for _ in range(150):
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    ok = r.status == 200
                    break
            except OSError:
                time.sleep(0.2)
        if not ok:
            proc.terminate()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"the controller did not start as its unit says:\n{err[-3000:]}")
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/jobs",
            headers={"Authorization": "Bearer s3cr3t-fleet-token"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["jobs"] == []  # the token came through the credential
        db = state / "controller.db"
        assert db.is_file() and db.stat().st_uid == UID, "the DB is in the StateDirectory"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    started = [rec for rec in lines if rec.get("msg") == "controller listening"]
    assert started and started[0]["provider"] == "aws", err[-2000:]
    assert any(rec.get("msg") == "watching fleet notices" for rec in lines), err[-2000:]
    assert not any(rec.get("level") == "error" for rec in lines), err[-2000:]


def test_the_agent_unit_keeps_its_state_in_its_state_directory() -> None:
    svc: dict[str, Any] = unit("spotguard-agent.service")
    env = dict(v.partition("=")[::2] for v in svc["Environment"])
    (state_name,) = svc["StateDirectory"]
    assert env["SPOTGUARD_STATE_DIR"] == f"/var/lib/{state_name}"
    assert "DynamicUser" not in svc and "User" not in svc, "CRIU needs root"
