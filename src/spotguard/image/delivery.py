"""Delivering the fleet's image keys to a VM at boot (``spotguard fetch-keys``).

A deployed fleet signs every image (:mod:`spotguard.image.keys`): agents need the private
signing key, every restoring host the public verify key. Neither may travel in user-data
(readable through the metadata service by any process on the VM), and a relaunched VM's
user-data is an assignment, not the first-boot script. So the VM is given only *where* the keys
live — a **key source** — and fetches them itself with its own cloud identity, before the agent
starts (``ExecStartPre`` of ``spotguard-agent.service``):

* ``aws-secretsmanager:<secret ARN or name>`` — AWS Secrets Manager (the private key);
* ``aws-ssm:<parameter ARN or name>`` — AWS Systems Manager Parameter Store (the public key);
* ``gcp-secretmanager:projects/<p>/secrets/<s>[/versions/<v>]`` — Google Secret Manager
  (version ``latest`` unless named);
* ``file:<path>`` — a file already on the host (manual installs, tests).

The sources come from the ``[keys]`` settings (the first boot's config, written by Terraform)
or else from the assignment (the controller hands every relaunched VM the same sources).
Both keys are parsed and checked against each other *before* anything is written; files are
written atomically (``signing.key`` 0600, ``signing.pub`` 0644), then an environment file names
them to the agent (``SPOTGUARD_SIGNING_KEY_FILE`` / ``SPOTGUARD_VERIFY_KEY_FILE``). A host
whose sources are set but unreachable fails (the agent does not start unauthenticated); a host
with no source at all (a manual install, the demo) gets no keys and a warning.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final

from pydantic import Field

from spotguard import retry as retries
from spotguard import safefs
from spotguard.config import Settings
from spotguard.errors import ConfigError, KeyFetchError, MissingExtra
from spotguard.image.keys import Signer, key_id, parse_signing_key, parse_verify_keys

log = logging.getLogger(__name__)

AWS_SM: Final = "aws-secretsmanager"
AWS_SSM: Final = "aws-ssm"
GCP_SM: Final = "gcp-secretmanager"
FILE: Final = "file"
KINDS: Final = (AWS_SM, AWS_SSM, GCP_SM, FILE)
GCP_ENDPOINT: Final = "https://secretmanager.googleapis.com"
SIGNING_NAME: Final = "signing.key"
VERIFY_NAME: Final = "signing.pub"
MAX_KEY_BYTES: Final = 64 << 10


class KeysSettings(Settings):
    """Where this VM fetches the fleet's image keys from, and where it writes them
    (config section ``[keys]``; read by ``spotguard fetch-keys``)."""

    section: ClassVar[str] = "keys"

    signing_key_source: str | None = Field(
        None,
        description="Where the private signing key lives (aws-secretsmanager:ARN, "
        "gcp-secretmanager:projects/P/secrets/S, file:PATH); agents only",
    )
    verify_key_source: str | None = Field(
        None,
        description="Where the public verify key(s) live (aws-ssm:ARN, aws-secretsmanager:ARN, "
        "gcp-secretmanager:projects/P/secrets/S, file:PATH)",
    )
    keys_dir: Path = Field(
        Path("/etc/spotguard"), description="Directory of signing.key (0600) and signing.pub"
    )
    keys_env_file: Path = Field(
        Path("/run/spotguard/keys.env"),
        description="Environment file naming the fetched key files to the agent unit",
    )
    keys_aws_region: str | None = Field(
        None, description="AWS region for sources given by name, not ARN (default: the SDK's)"
    )
    keys_gcp_endpoint: str = Field(
        GCP_ENDPOINT,
        description="Secret Manager endpoint (another one is used with anonymous credentials)",
    )
    keys_timeout_s: float = Field(
        120.0, gt=0, description="Seconds to keep retrying a source that fails transiently"
    )


@dataclass(frozen=True)
class KeySource:
    """One parsed key source: ``kind`` (one of :data:`KINDS`) and the ``ref`` it names."""

    kind: str
    ref: str

    @classmethod
    def parse(cls, text: str, what: str) -> KeySource:
        kind, sep, ref = text.strip().partition(":")
        if not sep or kind not in KINDS or not ref:
            raise ConfigError(
                f"{what} {text!r} is not a key source: expected one of "
                + ", ".join(f"{k}:…" for k in KINDS)
            )
        if kind == GCP_SM and not (ref.startswith("projects/") and "/secrets/" in ref):
            raise ConfigError(f"{what} {text!r}: expected {GCP_SM}:projects/<p>/secrets/<s>")
        return cls(kind, ref)

    def __str__(self) -> str:
        return f"{self.kind}:{self.ref}"


@dataclass(frozen=True)
class Fetched:
    """What ``fetch-keys`` wrote: paths and the key ids (never key material)."""

    signing_key_file: Path | None
    verify_key_file: Path | None
    signing_key_id: str | None
    verify_key_ids: tuple[str, ...]
    env_file: Path | None


class Transient(Exception):
    """A source failed in a way worth retrying (network, throttling, 5xx)."""


def _aws_region(ref: str, s: KeysSettings) -> str | None:
    """The region inside an ARN (arn:partition:service:region:account:…), else the setting."""
    parts = ref.split(":")
    if ref.startswith("arn:") and len(parts) >= 6 and parts[3]:
        return parts[3]
    return s.keys_aws_region


def _aws(source: KeySource, s: KeysSettings) -> bytes:
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError as exc:
        raise MissingExtra(
            f"{source.kind} needs boto3: pip install 'spotguard[aws]'", extra="aws"
        ) from exc
    region = _aws_region(source.ref, s)
    try:
        if source.kind == AWS_SM:
            client: Any = boto3.client("secretsmanager", region_name=region)
            got = client.get_secret_value(SecretId=source.ref)
            text = got.get("SecretString")
            return text.encode() if text is not None else bytes(got["SecretBinary"])
        client = boto3.client("ssm", region_name=region)
        return str(
            client.get_parameter(Name=source.ref, WithDecryption=True)["Parameter"]["Value"]
        ).encode()
    except ClientError as exc:
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if status >= 500 or code in ("ThrottlingException", "Throttling", "InternalServiceError"):
            raise Transient(f"{code or status}: {err.get('Message', '')}") from exc
        raise KeyFetchError(
            f"cannot read key source {source}: {code}: {err.get('Message', '')}"
        ) from exc
    except BotoCoreError as exc:  # no credentials yet, endpoint unreachable: boot races
        raise Transient(str(exc)) from exc


def _gcp(source: KeySource, s: KeysSettings) -> bytes:
    try:
        import google.auth
        import google_crc32c
        from google.auth.exceptions import GoogleAuthError
        from google.auth.transport.requests import AuthorizedSession
        from requests import RequestException
    except ImportError as exc:
        raise MissingExtra(
            f"{source.kind} needs google-auth: pip install 'spotguard[gcp]'", extra="gcp"
        ) from exc
    name = source.ref if "/versions/" in source.ref else f"{source.ref}/versions/latest"
    scope = "https://www.googleapis.com/auth/cloud-platform"
    try:
        if s.keys_gcp_endpoint.rstrip("/") != GCP_ENDPOINT:
            from google.auth.credentials import AnonymousCredentials

            creds: Any = AnonymousCredentials()  # type: ignore[no-untyped-call]
        else:
            creds, _ = google.auth.default(scopes=[scope])
        session = AuthorizedSession(creds)  # type: ignore[no-untyped-call]
        r = session.get(f"{s.keys_gcp_endpoint.rstrip('/')}/v1/{name}:access", timeout=30)
    except (GoogleAuthError, RequestException) as exc:
        raise Transient(str(exc)) from exc
    if r.status_code >= 500 or r.status_code == 429:
        raise Transient(f"HTTP {r.status_code}")
    if r.status_code != 200:
        raise KeyFetchError(
            f"cannot read key source {source}: HTTP {r.status_code}: {r.text[:200]}"
        )
    try:
        payload = r.json()["payload"]
        data = base64.b64decode(payload["data"], validate=True)
    except (ValueError, KeyError, TypeError) as exc:
        raise KeyFetchError(f"key source {source} answered without a payload") from exc
    crc = payload.get("dataCrc32c")
    if crc is not None and int(crc) != google_crc32c.value(data):
        raise Transient(f"payload of {name} failed its CRC32C check")
    return data


def _file(source: KeySource, s: KeysSettings) -> bytes:
    try:
        return Path(source.ref).read_bytes()
    except OSError as exc:
        raise KeyFetchError(f"cannot read key source {source}: {exc.strerror}") from exc


READERS: dict[str, Callable[[KeySource, KeysSettings], bytes]] = {
    AWS_SM: _aws,
    AWS_SSM: _aws,
    GCP_SM: _gcp,
    FILE: _file,
}


def read_source(
    source: KeySource, s: KeysSettings, *, sleep: Callable[[float], None] = time.sleep
) -> bytes:
    """The bytes at ``source``; transient failures are retried for ``keys_timeout_s``
    (waits of 1 s doubling up to 15 s; none that would end past the bound)."""

    def logged(r: retries.Retry) -> None:
        log.warning(
            "key source failing, retrying",
            extra={"key_source": str(source), "error": str(r.error)},
        )

    policy = retries.RetryPolicy(
        attempts=None, initial=1.0, maximum=15.0, jitter=0, within=s.keys_timeout_s
    )
    try:
        data = retries.call_blocking(
            lambda: READERS[source.kind](source, s), policy, Transient, on_retry=logged, sleep=sleep
        )
    except Transient as exc:
        raise KeyFetchError(
            f"key source {source} still failing after {s.keys_timeout_s:.0f} s: {exc}"
        ) from exc
    if len(data) > MAX_KEY_BYTES:
        raise KeyFetchError(f"key source {source} holds {len(data)} bytes: not a key")
    return data


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically and durably (:func:`spotguard.safefs.write_atomic`)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    safefs.write_atomic(path, data, mode=mode)


def fetch_keys(
    s: KeysSettings,
    signing: KeySource | None,
    verify: KeySource | None,
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> Fetched:
    """Fetch, check and write the keys named by ``signing`` / ``verify`` (see the module doc).

    Raises :class:`~spotguard.errors.KeyFetchError` when a source cannot be read and
    :class:`~spotguard.errors.ConfigError` when what it holds is not the expected key, or the
    signing key is not among the verify keys (this host's images would be refused elsewhere).
    Nothing is written unless every configured key was read and checked.
    """
    signer: Signer | None = None
    if signing is not None:
        signer = parse_signing_key(read_source(signing, s, sleep=sleep), str(signing))
    publics = []
    verify_text = b""
    if verify is not None:
        verify_text = read_source(verify, s, sleep=sleep)
        publics = parse_verify_keys(verify_text.decode(errors="replace"), str(verify))
        if not publics:
            raise ConfigError(f"key source {verify} holds no public key")
    ids = tuple(key_id(k) for k in publics)
    if signer is not None and publics and signer.key_id not in ids:
        raise ConfigError(
            f"signing key {signer.key_id} from {signing} is not among the verify keys "
            f"({', '.join(ids)}) from {verify}: other hosts would refuse this host's images"
        )
    sk_file = s.keys_dir / SIGNING_NAME if signer is not None else None
    vk_file = s.keys_dir / VERIFY_NAME if publics else None
    if sk_file is not None and signer is not None:
        _write(sk_file, _pem(signer), 0o600)
    if vk_file is not None:
        _write(vk_file, verify_text if verify_text.endswith(b"\n") else verify_text + b"\n", 0o644)
    env_lines = []
    if sk_file is not None:
        env_lines.append(f"SPOTGUARD_SIGNING_KEY_FILE={sk_file}")
    if vk_file is not None:
        env_lines.append(f"SPOTGUARD_VERIFY_KEY_FILE={vk_file}")
    env_file: Path | None = None
    if env_lines:
        env_file = s.keys_env_file
        _write(env_file, ("\n".join(env_lines) + "\n").encode(), 0o600)
    else:
        s.keys_env_file.unlink(missing_ok=True)
    return Fetched(sk_file, vk_file, signer.key_id if signer else None, ids, env_file)


def _pem(signer: Signer) -> bytes:
    """The signing key as PKCS#8 PEM, whatever form the source held it in."""
    from cryptography.hazmat.primitives import serialization

    data: bytes = signer.private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return data
