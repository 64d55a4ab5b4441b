"""Key delivery (issue 15.1): ``spotguard fetch-keys`` as the agent unit runs it at boot, against
a real moto server (Secrets Manager, SSM) and a local Secret Manager stand-in (an aiohttp server
answering ``GET /v1/projects/*/secrets/*/versions/*:access`` as Google documents it, with the
payload's CRC32C), then the keys it wrote used for real: a signed image is accepted, an unsigned
one refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import google_crc32c
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sgtest import sg
from spotguard.contracts import Assignment, KeySources
from spotguard.errors import ConfigError, KeyFetchError
from spotguard.image.delivery import KeySource, KeysSettings, fetch_keys
from spotguard.image.keys import key_id


def pair() -> tuple[str, str, str]:
    """(OpenSSH private key, ``ssh-ed25519`` public line, key id) as Terraform's tls_private_key
    writes them (private_key_openssh, public_key_openssh)."""
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


@pytest.fixture
def aws_keys(aws_env: str) -> dict[str, str]:
    """The fleet's keys stored as the Terraform module stores them (keys.tf)."""
    priv, pub, kid = pair()
    sm = boto3.client("secretsmanager", region_name="us-east-1")
    secret = sm.create_secret(Name=f"sg-{kid}/image-signing-key", SecretString=priv)["ARN"]
    ssm = boto3.client("ssm", region_name="us-east-1")
    ssm.put_parameter(Name=f"/sg-{kid}/image-verify-key", Value=pub.strip(), Type="String")
    param = ssm.get_parameter(Name=f"/sg-{kid}/image-verify-key")["Parameter"]["ARN"]
    return {"secret": secret, "parameter": param, "key_id": kid, "public": pub}


def write_config(tmp: Path, signing: str | None, verify: str | None) -> Path:
    lines = [
        "[keys]",
        f'keys_dir = "{tmp / "etc"}"',
        f'keys_env_file = "{tmp / "run" / "keys.env"}"',
    ]
    if signing:
        lines.append(f"signing_key_source = {json.dumps(signing)}")
    if verify:
        lines.append(f"verify_key_source = {json.dumps(verify)}")
    cfg = tmp / "spotguard.toml"
    cfg.write_text("\n".join(lines) + "\n")
    return cfg


def test_first_boot_fetch_from_secrets_manager_and_ssm_then_unsigned_images_are_refused(
    aws_keys: dict[str, str], aws_env: str, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path,
        f"aws-secretsmanager:{aws_keys['secret']}",
        f"aws-ssm:{aws_keys['parameter']}",
    )
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    got = sg(
        "--config", str(cfg), "fetch-keys", "--assignment", str(tmp_path / "none.json"), env=aws
    )
    assert got.returncode == 0, got.stderr
    assert f"signing key {aws_keys['key_id']}" in got.stdout
    sk, vk = tmp_path / "etc" / "signing.key", tmp_path / "etc" / "signing.pub"
    assert sk.stat().st_mode & 0o777 == 0o600 and vk.stat().st_mode & 0o777 == 0o644
    assert b"PRIVATE KEY" in sk.read_bytes()
    assert vk.read_text() == aws_keys["public"]
    keys_env = env_file(tmp_path / "run" / "keys.env")
    assert keys_env == {"SPOTGUARD_SIGNING_KEY_FILE": str(sk), "SPOTGUARD_VERIFY_KEY_FILE": str(vk)}
    assert (tmp_path / "run" / "keys.env").stat().st_mode & 0o777 == 0o600

    # The agent's environment now holds the keys: what it pushes is signed, what is not signed
    # by the fleet is refused.
    src = tmp_path / "src"
    src.mkdir()
    (src / "pages-1.img").write_bytes(os.urandom(100_000))
    store = tmp_path / "store"
    signed = sg("images", "push", str(src), str(store), "--job", "j", "--json", env=keys_env)
    assert signed.returncode == 0, signed.stderr
    ok = sg("images", "verify", json.loads(signed.stdout)["image"], env=keys_env)
    assert ok.returncode == 0 and f"ed25519:{aws_keys['key_id']}" in ok.stdout, ok.stderr
    plain = sg("images", "push", str(src), str(store), "--job", "j", "--json")
    refused = sg("images", "verify", json.loads(plain.stdout)["image"], env=keys_env)
    assert refused.returncode == 1 and "is not signed" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_relaunched_vm_fetches_the_sources_its_assignment_names(
    aws_keys: dict[str, str], aws_env: str, tmp_path: Path
) -> None:
    """A relaunched VM has no first-boot config: the controller's assignment names the
    sources (never the keys), and fetch-keys reads them from the file user-data wrote."""
    sources = KeySources(
        signing_key=f"aws-secretsmanager:{aws_keys['secret']}",
        verify_key=f"aws-ssm:{aws_keys['parameter']}",
    )
    user_data = Assignment(
        job="j", image_url="s3://b/j/images/1", store="s3://b", keys=sources
    ).user_data()
    assert "PRIVATE KEY" not in user_data and "ssh-ed25519" not in user_data
    assignment = tmp_path / "assignment.json"
    assignment.write_text(Assignment.from_user_data(user_data).model_dump_json())
    cfg = write_config(tmp_path, None, None)
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    got = sg(
        "--config", str(cfg), "fetch-keys", env={**aws, "SPOTGUARD_ASSIGNMENT": str(assignment)}
    )
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "etc" / "signing.key").is_file()
    assert (tmp_path / "etc" / "signing.pub").read_text() == aws_keys["public"]


def test_failures_are_one_line_and_write_nothing(
    aws_keys: dict[str, str], aws_env: str, tmp_path: Path
) -> None:
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    none = str(tmp_path / "none.json")
    missing = write_config(tmp_path, "aws-secretsmanager:no-such-secret", None)
    got = sg("--config", str(missing), "fetch-keys", "--assignment", none, env=aws)
    assert got.returncode == 1 and "ResourceNotFoundException" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "etc").exists() and not (tmp_path / "run").exists()

    # Keys of two different pairs: other hosts would refuse this host's images.
    other_priv, _, _ = pair()
    (tmp_path / "other.key").write_text(other_priv)
    mixed = write_config(
        tmp_path, f"file:{tmp_path / 'other.key'}", f"aws-ssm:{aws_keys['parameter']}"
    )
    got = sg("--config", str(mixed), "fetch-keys", "--assignment", none, env=aws)
    assert got.returncode == 2 and "is not among the verify keys" in got.stderr, got.stderr
    assert not (tmp_path / "etc").exists()

    # A secret that holds something else than a key.
    sm = boto3.client("secretsmanager", region_name="us-east-1")
    junk = sm.create_secret(Name=f"junk-{aws_keys['key_id']}", SecretString="hunter2")["ARN"]
    bad = write_config(tmp_path, f"aws-secretsmanager:{junk}", None)
    got = sg("--config", str(bad), "fetch-keys", "--assignment", none, env=aws)
    assert got.returncode == 2 and "not an Ed25519 private key" in got.stderr
    assert "hunter2" not in got.stderr

    typo = write_config(tmp_path, "secretsmanager:x", None)
    got = sg("--config", str(typo), "fetch-keys", "--assignment", none, env=aws)
    assert got.returncode == 2 and "is not a key source" in got.stderr


def test_no_source_anywhere_means_no_keys_and_a_stale_env_file_is_removed(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, None, None)
    stale = tmp_path / "run" / "keys.env"
    stale.parent.mkdir()
    stale.write_text("SPOTGUARD_SIGNING_KEY_FILE=/gone\n")
    got = sg("--config", str(cfg), "fetch-keys", "--assignment", str(tmp_path / "none.json"))
    assert got.returncode == 0 and "no key source configured" in got.stdout, got.stderr
    assert not stale.exists()


# ----- Google Secret Manager ---------------------------------------------------------------


class FakeSecretManager:
    """Secret Manager's ``versions/*:access`` over HTTP; ``fail`` answers 503 that many times."""

    def __init__(self) -> None:
        self.secrets: dict[str, bytes] = {}
        self.fail = 0
        self.calls = 0

    async def access(self, request: web.Request) -> web.Response:
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            return web.json_response({"error": {"code": 503}}, status=503)
        name = request.match_info["name"]
        secret, _, version = name.partition("/versions/")
        if secret not in self.secrets or version != "latest":
            return web.json_response({"error": {"code": 404, "message": "not found"}}, status=404)
        data = self.secrets[secret]
        payload: dict[str, Any] = {
            "data": base64.b64encode(data).decode(),
            "dataCrc32c": str(google_crc32c.value(data)),
        }
        return web.json_response({"name": f"{secret}/versions/1", "payload": payload})


@pytest.fixture
def gcp_sm() -> Iterator[tuple[str, FakeSecretManager]]:
    fake = FakeSecretManager()
    app = web.Application()
    app.router.add_get(r"/v1/{name:projects/.+}:access", fake.access)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_gcp_secret_manager_sources_with_transient_failures_retried(
    gcp_sm: tuple[str, FakeSecretManager], tmp_path: Path
) -> None:
    url, fake = gcp_sm
    priv, pub, kid = pair()
    fake.secrets["projects/p1/secrets/sg-image-signing-key"] = priv.encode()
    fake.secrets["projects/p1/secrets/sg-image-verify-key"] = pub.encode()
    fake.fail = 2
    s = KeysSettings(
        keys_dir=tmp_path / "etc",
        keys_env_file=tmp_path / "run" / "keys.env",
        keys_gcp_endpoint=url,
    )
    slept: list[float] = []
    got = fetch_keys(
        s,
        KeySource.parse("gcp-secretmanager:projects/p1/secrets/sg-image-signing-key", "s"),
        KeySource.parse("gcp-secretmanager:projects/p1/secrets/sg-image-verify-key", "v"),
        sleep=slept.append,
    )
    assert slept == [1.0, 2.0] and fake.calls == 4
    assert got.signing_key_id == kid and got.verify_key_ids == (kid,)
    assert (tmp_path / "etc" / "signing.pub").read_text() == pub

    with pytest.raises(KeyFetchError, match="HTTP 404"):
        fetch_keys(s, KeySource.parse("gcp-secretmanager:projects/p1/secrets/nope", "s"), None)
    fake.fail = 100
    short = s.model_copy(update={"keys_timeout_s": 2.0})
    with pytest.raises(KeyFetchError, match="still failing"):
        fetch_keys(
            short,
            KeySource.parse("gcp-secretmanager:projects/p1/secrets/sg-image-signing-key", "s"),
            None,
            sleep=lambda _: None,
        )
    with pytest.raises(ConfigError, match="projects/<p>/secrets/<s>"):
        KeySource.parse("gcp-secretmanager:sg-image-signing-key", "signing_key_source")


def test_the_controller_names_the_key_sources_in_every_assignment() -> None:
    """What the Terraform controller_config sets ([controller] vm_*_key_source, or a job's own
    in vm_*_key_sources) reaches the assignment of each VM the controller launches (the
    reconciler builds it with ``settings.vm_key_sources(job)``, shown on a real controller by
    tests/controller/test_controller_local.py::test_each_relaunched_vm_gets_its_own_jobs_key_sources);
    without it, no keys."""
    from spotguard.controller.settings import ControllerSettings

    s = ControllerSettings(
        vm_signing_key_source="aws-secretsmanager:arn:aws:secretsmanager:r:1:secret:k",
        vm_verify_key_source="aws-ssm:arn:aws:ssm:r:1:parameter/v",
    )
    got = s.vm_key_sources("j")
    assert got == KeySources(signing_key=s.vm_signing_key_source, verify_key=s.vm_verify_key_source)
    assert ControllerSettings().vm_key_sources("j") is None
