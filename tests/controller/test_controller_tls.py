"""Transport and secrets: HTTPS with a certificate (self-signed, made by ``cryptography``),
plain HTTP refused on a non-loopback address unless told, the admin token kept off argv, VM
tokens issued by the command, and an agent's reporter told to stand down by a 409."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from controller_helpers import TOKEN, Factory
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spotguard.agent.reporter import Reporter
from spotguard.contracts import EventAnswer, EventKind, make_event
from spotguard.controller.client import ControllerClient
from spotguard.controller.server import ControllerServer
from spotguard.controller.settings import ControllerSettings
from spotguard.controller.tokens import Caller, TokenKeys
from spotguard.errors import ConfigError, ControllerError
from spotguard.image.settings import ImageSettings
from spotguard.providers.local import LocalProvider, LocalSettings

SPOTGUARD = str(Path(sys.executable).with_name("spotguard"))


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spotguard-controller")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


def settings(tmp_path: Path, **kw: Any) -> ControllerSettings:
    base: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "state": tmp_path / "c.db",
        "controller_token": TOKEN,
        "tick_s": 0.05,
    }
    return ControllerSettings(**(base | kw))


def provider(tmp_path: Path) -> LocalProvider:
    return LocalProvider(LocalSettings(local_root=tmp_path / "local", local_gpus=False))


async def test_controller_serves_https_with_a_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    s = settings(tmp_path, tls_cert_file=cert, tls_key_file=key)
    image = ImageSettings.model_validate({})
    async with ControllerServer(s, provider=provider(tmp_path), image=image) as srv:
        assert srv.url.startswith("https://127.0.0.1:")
        assert srv.controller.public_url.startswith("https://")  # what VMs are told
        client = ControllerClient(srv.url, TOKEN, ca_file=cert)
        assert (await client.get("/v1/jobs")) == {"jobs": []}
        untrusted = ControllerClient(srv.url, TOKEN)  # the system CAs do not know it
        with pytest.raises(ControllerError, match="unreachable") as untrusted_err:
            await untrusted.get("/v1/jobs")
        assert "its TLS certificate is not trusted" in str(untrusted_err.value)
        assert "ConnectionKey" not in str(untrusted_err.value)
        plain = srv.url.replace("https://", "http://")
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.ClientError):
                async with http.get(plain + "/healthz") as r:
                    await r.read()
        ctx = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/healthz", ssl=ctx) as r:
            assert (await r.json()) == {"ok": True, "jobs": 0}


def test_plain_http_on_a_public_address_is_refused_unless_told(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a loopback address"):
        settings(tmp_path, listen="0.0.0.0:8700").tls()
    assert settings(tmp_path, listen="0.0.0.0:8700", insecure_listen=True).tls() is None
    assert settings(tmp_path, listen="[::1]:8700").tls() is None
    assert settings(tmp_path, listen="localhost:8700").tls() is None
    cert, _ = self_signed(tmp_path)
    with pytest.raises(ConfigError, match="set together"):
        settings(tmp_path, tls_cert_file=cert).tls()
    with pytest.raises(ConfigError, match="unusable"):
        settings(tmp_path, tls_cert_file=cert, tls_key_file=cert).tls()


def test_vm_token_key_from_a_file_and_tokens_are_scoped(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="at least 32"):
        settings(tmp_path, vm_token_key_file=short).token_keys()
    keyfile = tmp_path / "vm.key"
    keyfile.write_text("k" * 64)
    keys = settings(tmp_path, vm_token_key_file=keyfile).token_keys()
    tok = keys.issue("train.v2", 3)
    assert keys.verify(tok) == Caller(admin=False, job="train.v2", epoch=3)
    assert keys.verify(TOKEN) == Caller(admin=True)
    other = TokenKeys(TOKEN)  # derived key: a token of another key is not accepted
    with pytest.raises(Exception, match="wrong bearer token"):
        other.verify(tok)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPOTGUARD, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_cli_issues_vm_tokens_and_refuses_a_token_on_argv(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTGUARD_")}
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    env |= {"SPOTGUARD_CONTROLLER_TOKEN_FILE": str(token_file)}
    out = run_cli("controller", "--issue-token", "train", env=env)
    assert out.returncode == 0, out.stderr
    assert TokenKeys(TOKEN).verify(out.stdout.strip()) == Caller(False, "train", 0)
    assert "ps" not in out.stderr
    argv = run_cli("controller", "--token", "inline", "--issue-token", "train", env=env)
    assert argv.returncode == 2 and "(ps)" in argv.stderr and "inline" not in argv.stderr
    refused = run_cli(
        "controller", "--listen", "0.0.0.0:0", "--state", str(tmp_path / "x.db"), env=env
    )
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr
    assert "Traceback" not in refused.stderr


async def test_reporter_of_a_fenced_agent_is_told_to_stand_down(
    api_factory: Factory, tmp_path: Path
) -> None:
    api, srv, _ = await api_factory()
    keys = TokenKeys(TOKEN)
    vm1 = {"provider": "local", "instance_id": "vm1"}
    image = f"file://{tmp_path}/store/train/images/20260101T000000000000Z-abcdef"
    for kind, kw in [
        (EventKind.STARTED, {}),
        (EventKind.DURABLE, {"image_url": image}),
    ]:
        ev = make_event(kind, job="train", instance=vm1, **kw)
        await api.post_raw(ev.model_dump_json(), token=keys.issue("train", 0))
    r = await api.s.post(
        api.url + "/v1/jobs/train/migrate",
        json={"to": "local", "immediate": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status == 200, await r.text()  # a relaunch: epoch 1 owns the job now
    answers: list[EventAnswer] = []
    old = Reporter(api.url, keys.issue("train", 0), tmp_path / "outbox", on_answer=answers.append)
    await old.start()
    old.emit(make_event(EventKind.JOB_FINISHED, job="train", instance=vm1))
    assert await old.flush(10)
    await old.aclose()
    assert answers and answers[0].stand_down is True and answers[0].stale is True
    assert answers[0].owner.epoch == 1
    view = await api.get("/v1/jobs/train")
    assert view["state"] != "finished"
    await asyncio.sleep(0)
    assert srv.controller.metrics.stale.labels("job_finished")._value.get() == 1
