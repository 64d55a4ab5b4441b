"""One signing key per job (issue 27, item 6): a VM holds only its own job's private key, so a
VM taken over can sign images of its own job and of no other.

Real mechanisms: the keys stored per job in a moto server (Secrets Manager, SSM) as the
Terraform modules store them (``<name>/image-signing-key/<job>``,
``/<name>/image-verify-key/<job>`` holding ``job=<job> ssh-ed25519 …``); the controller's own
settings choose the sources it hands each job's VMs; ``spotguard fetch-keys`` run from the
assignment as the agent unit runs it; images pushed and verified by the ``spotguard`` CLI.

Before: one fleet key, readable by every VM, signed every job's images and every host
trusted it for every job — a VM of job A could push an image of job B that B's hosts and the
controller accepted (``job=`` bindings did not exist: they were refused as malformed keys).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import boto3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sgtest import sg
from spotguard.contracts import Assignment
from spotguard.controller.settings import ControllerSettings
from spotguard.errors import ConfigError
from spotguard.image.keys import ImageKeys, key_id, parse_scoped_verify_keys
from spotguard.image.settings import ImageSettings

JOBS = ("j1", "j2")
NAME = "sgk"


def pair() -> tuple[str, str, str]:
    """(OpenSSH private key, ``ssh-ed25519`` public line, key id), as tls_private_key makes."""
    k = Ed25519PrivateKey.generate()
    priv = k.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    ).decode()
    pub = k.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return priv, pub.decode() + "\n", key_id(k.public_key())


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def store_job_keys(job: str) -> dict[str, str]:
    """One job's pair stored as keys.tf stores it; returns its ARNs and public line."""
    priv, pub, kid = pair()
    line = f"job={job} {pub.strip()}"
    sm = boto3.client("secretsmanager", region_name="us-east-1")
    secret = sm.create_secret(
        Name=f"{NAME}-{kid}/image-signing-key/{job}",
        SecretString=priv,
        Tags=[{"Key": "spotguard:job", "Value": job}],
    )["ARN"]
    ssm = boto3.client("ssm", region_name="us-east-1")
    pname = f"/{NAME}-{kid}/image-verify-key/{job}"
    ssm.put_parameter(Name=pname, Value=line, Type="String")
    param = ssm.get_parameter(Name=pname)["Parameter"]["ARN"]
    return {"secret": secret, "parameter": param, "key_id": kid, "line": line, "public": pub}


def fetch_as_vm_of(job: str, settings: ControllerSettings, tmp: Path) -> dict[str, str]:
    """A VM the controller launched for ``job``: its assignment (built from the controller's
    settings) → ``spotguard fetch-keys`` → the environment the agent unit gets."""
    sources = settings.vm_key_sources(job)
    assert sources is not None
    user_data = Assignment(
        job=job, image_url=f"s3://b/{job}/images/1", store="s3://b", keys=sources
    ).user_data()
    assert "PRIVATE KEY" not in user_data and "ssh-ed25519" not in user_data
    vm = tmp / f"vm-{job}"
    vm.mkdir()
    assignment = vm / "assignment.json"
    assignment.write_text(Assignment.from_user_data(user_data).model_dump_json())
    cfg = vm / "spotguard.toml"
    cfg.write_text(f'[keys]\nkeys_dir = "{vm / "etc"}"\nkeys_env_file = "{vm / "keys.env"}"\n')
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    got = sg("--config", str(cfg), "fetch-keys", "--assignment", str(assignment), env=aws)
    assert got.returncode == 0, got.stderr
    return env_file(vm / "keys.env")


def push(src: Path, store: Path, job: str, env: dict[str, str]) -> str:
    out = sg("images", "push", str(src), str(store), "--job", job, "--json", env=env)
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["image"])


def verify(image: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return sg("images", "verify", image, env=env)


def test_a_vm_signs_only_its_own_jobs_images(aws_env: str, tmp_path: Path) -> None:
    keys = {job: store_job_keys(job) for job in JOBS}
    _, fleet_pub, fleet_id = pair()  # an earlier fleet key, still trusted for old images
    controller = ControllerSettings(
        vm_signing_key_sources={j: f"aws-secretsmanager:{k['secret']}" for j, k in keys.items()},
        vm_verify_key_sources={j: f"aws-ssm:{k['parameter']}" for j, k in keys.items()},
    )
    vm1 = fetch_as_vm_of("j1", controller, tmp_path)
    vm2 = fetch_as_vm_of("j2", controller, tmp_path)
    # each VM got its own job's private key, and trusts its own job's public key only
    for job, vm in (("j1", vm1), ("j2", vm2)):
        got = ImageKeys.from_settings(
            ImageSettings(
                signing_key_file=Path(vm["SPOTGUARD_SIGNING_KEY_FILE"]),
                verify_key_file=Path(vm["SPOTGUARD_VERIFY_KEY_FILE"]),
            )
        )
        assert got.signer is not None and got.signer.key_id == keys[job]["key_id"]
        assert set(got.trusted) == {keys[job]["key_id"]}
        assert got.scopes == {keys[job]["key_id"]: frozenset({job})}  # bound, on its VM too
    # the controller trusts every job's key, each for its own job (terraform's verify_key)
    ctl = {
        "SPOTGUARD_VERIFY_KEY": ", ".join(
            [keys["j1"]["line"], keys["j2"]["line"], fleet_pub.strip()]
        )
    }

    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(50_000))
    store = tmp_path / "store"
    own = push(src, store, "j1", vm1)
    for env in (vm1, ctl):
        ok = verify(own, env)
        assert ok.returncode == 0 and f"ed25519:{keys['j1']['key_id']}" in ok.stdout, ok.stderr

    # j1's VM (its private key, a writer of the store) makes an image of job j2
    forged = push(src, store, "j2", vm1)
    on_j2 = verify(forged, vm2)
    assert on_j2.returncode == 1 and "which this host does not trust" in on_j2.stderr
    on_ctl = verify(forged, ctl)
    assert on_ctl.returncode == 1, on_ctl.stdout
    assert "trusts only for job(s) j1: another job's key" in on_ctl.stderr
    assert "Traceback" not in on_j2.stderr + on_ctl.stderr
    genuine = push(src, store, "j2", vm2)
    assert verify(genuine, ctl).returncode == 0 and verify(genuine, vm2).returncode == 0
    # the earlier fleet key, listed without a job, is trusted for every job's old images
    ctl_keys = ImageKeys.from_settings(ImageSettings(verify_key=ctl["SPOTGUARD_VERIFY_KEY"]))
    assert fleet_id in ctl_keys.trusted and fleet_id not in ctl_keys.scopes


def test_job_bound_keys_parse_and_a_key_listed_without_a_job_serves_every_job() -> None:
    _, pub, kid = pair()
    line = pub.strip()
    assert parse_scoped_verify_keys(f"job=a {line}", "t")[0][1] == "a"
    both = ImageKeys.from_settings(ImageSettings(verify_key=f"job=a {line}, job=b {line}"))
    assert both.scopes[kid] == frozenset({"a", "b"})
    anyjob = ImageKeys.from_settings(ImageSettings(verify_key=f"job=a {line}, {line}"))
    assert kid not in anyjob.scopes
    for bad in ("job= " + line, "job=a", "job=a not-a-key"):
        with pytest.raises(ConfigError):
            parse_scoped_verify_keys(bad, "t")


def test_the_controller_hands_each_job_its_own_sources_and_others_the_fleets() -> None:
    s = ControllerSettings(
        vm_signing_key_source="file:/fleet.key",
        vm_verify_key_source="file:/fleet.pub",
        vm_signing_key_sources={"j1": "file:/j1.key"},
        vm_verify_key_sources={"j1": "file:/j1.pub"},
    )
    j1, other = s.vm_key_sources("j1"), s.vm_key_sources("j9")
    assert j1 is not None and (j1.signing_key, j1.verify_key) == ("file:/j1.key", "file:/j1.pub")
    assert other is not None and other.signing_key == "file:/fleet.key"
    assert ControllerSettings().vm_key_sources("j1") is None
