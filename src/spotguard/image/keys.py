"""Who may write an image that a host will restore: manifest authentication.

Restore runs as root and rebuilds processes, files and memory from a store; anyone who can
write to the store would own every VM that restores from it. So every manifest is
authenticated over everything restore relies on — the file list with every chunk's address and
size, the job, the image id, the per-job ``sequence``, ``meta`` (the engine's facts, the
controller's GPU choice) — and chunks are bound to the manifest by their addresses (content
hashes), so the one check covers every byte.

* **Ed25519 signatures** (``ed25519``): the agent signs with the fleet's private key
  (``signing_key_file``); restoring hosts hold only public keys (``verify_key_file`` /
  ``verify_key``), so a restoring host cannot forge an image. A host that trusts a key restores
  only images signed by it.
* **Per-job keys**: a verify key line may be bound to one job (``job=<name> ssh-ed25519 …``):
  that key then authenticates only manifests whose (signed) ``job`` is that job. Deployed
  fleets give every job its own signing key (only that job's VMs can read it) and the
  controller every job's public key, each bound to its job, so one VM's key cannot forge an
  image of another job for any host.
* **Encryption implies authentication** (``hmac-sha256``): an encrypted image's manifest
  carries an HMAC-SHA256 under a subkey of the encryption key; a host holding an encryption
  key refuses plaintext images and images whose MAC fails. Every holder of that key can
  forge: it authenticates the fleet against outsiders, not hosts against each other.

What is signed: ``spotguard-manifest/1 NUL`` followed by the manifest's JSON as parsed from the
store, ``auth`` removed, re-serialised canonically (sorted keys, no spaces, UTF-8). Signing the
parsed JSON rather than the model keeps fields a reader does not know covered too.
Threat model and tests: docs/security.md.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from blake3 import blake3
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from spotguard.errors import BadSignature, ConfigError, UnsignedImage, UntrustedSigner
from spotguard.image.codec import Cipher, load_key
from spotguard.image.manifest import Manifest, Signature
from spotguard.image.settings import ImageSettings

log = logging.getLogger(__name__)

CONTEXT = b"spotguard-manifest/1\x00"
ED25519: Final = "ed25519"
HMAC: Final = "hmac-sha256"
SIG_BYTES = 64


def canonical(raw: Mapping[str, Any]) -> bytes:
    """The bytes a manifest's signature covers (see the module doc)."""
    body = {k: v for k, v in raw.items() if k != "auth"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return CONTEXT + text.encode()


def key_id(public: Ed25519PublicKey) -> str:
    """16 hex digits naming (never revealing anything beyond) a public key."""
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return blake3(b"spotguard-key-id\x00" + raw).hexdigest()[:16]


@dataclass(frozen=True)
class Signer:
    """The fleet's private key, as an agent holds it."""

    private: Ed25519PrivateKey

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @property
    def key_id(self) -> str:
        return key_id(self.public)

    def sign(self, payload: bytes) -> Signature:
        sig = base64.b64encode(self.private.sign(payload)).decode()
        return Signature(alg=ED25519, key_id=self.key_id, sig=sig)

    def __repr__(self) -> str:  # never print key material
        return f"Signer(key_id={self.key_id!r})"


def _raw32(text: bytes) -> bytes | None:
    """32 bytes given raw, as 64 hex digits or as base64; None otherwise."""
    if len(text) == 32:
        return text
    s = text.strip()
    if len(s) == 64:
        try:
            return binascii.unhexlify(s)
        except binascii.Error:
            pass
    try:
        raw = base64.b64decode(s, validate=True)
    except binascii.Error:
        return None
    return raw if len(raw) == 32 else None


def parse_signing_key(data: bytes, where: str) -> Signer:
    """An Ed25519 private key: PKCS#8 PEM, OpenSSH, or the 32-byte seed (raw/hex/base64)."""
    try:
        if b"-----BEGIN OPENSSH PRIVATE KEY-----" in data:
            key: Any = serialization.load_ssh_private_key(data, password=None)
        elif b"-----BEGIN" in data:
            key = serialization.load_pem_private_key(data, password=None)
        else:
            seed = _raw32(data)
            if seed is None:
                raise ValueError("not PEM, OpenSSH or a 32-byte seed (raw, hex or base64)")
            key = Ed25519PrivateKey.from_private_bytes(seed)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"signing key {where} is not an Ed25519 private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"signing key {where} is a {type(key).__name__}, not Ed25519")
    return Signer(key)


def _public_line(line: str, where: str) -> Ed25519PublicKey:
    try:
        if line.startswith("ssh-"):
            key: Any = serialization.load_ssh_public_key(line.encode())
        else:
            raw = _raw32(line.encode())
            if raw is None:
                raise ValueError("not an OpenSSH key or 32 bytes as hex or base64")
            key = Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"verify key {line[:24]!r}… in {where}: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"verify key in {where} is a {type(key).__name__}, not Ed25519")
    return key


JOB_SCOPE: Final = "job="


def parse_verify_keys(text: str, where: str) -> list[Ed25519PublicKey]:
    """Ed25519 public keys: PEM blocks, ``ssh-ed25519 …`` lines, or 32 bytes as hex/base64
    (one per line or separated by commas); blank lines and ``#`` comments are skipped. A line
    may be bound to a job (``job=<name> <key>``): see :func:`parse_scoped_verify_keys`."""
    return [k for k, _ in parse_scoped_verify_keys(text, where)]


def parse_scoped_verify_keys(text: str, where: str) -> list[tuple[Ed25519PublicKey, str | None]]:
    """The keys of :func:`parse_verify_keys`, each with the job it is bound to (``None``: a
    key trusted for every job, as PEM blocks always are)."""
    keys: list[tuple[Ed25519PublicKey, str | None]] = []
    rest: list[str] = []
    while "-----BEGIN PUBLIC KEY-----" in text:
        start = text.index("-----BEGIN PUBLIC KEY-----")
        end = text.find("-----END PUBLIC KEY-----", start)
        if end < 0:
            raise ConfigError(f"unterminated PEM public key in {where}")
        end += len("-----END PUBLIC KEY-----")
        try:
            key = serialization.load_pem_public_key(text[start:end].encode())
        except (ValueError, UnsupportedAlgorithm) as exc:
            raise ConfigError(f"bad PEM public key in {where}: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"public key in {where} is a {type(key).__name__}, not Ed25519")
        keys.append((key, None))
        rest.append(text[:start])
        text = text[end:]
    rest.append(text)
    for chunk in rest:
        for line in chunk.replace(",", "\n").splitlines():
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            job: str | None = None
            if line.startswith(JOB_SCOPE):
                scope, _, line = line.partition(" ")
                job, line = scope[len(JOB_SCOPE) :], line.strip()
                if not job or not line:
                    raise ConfigError(
                        f"verify key {scope!r} in {where}: expected job=<name> <public key>"
                    )
            keys.append((_public_line(line, where), job))
    return keys


def generate_signing_key() -> tuple[bytes, bytes]:
    """A fresh Ed25519 key pair: (private key as PKCS#8 PEM, public key as PEM)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pub = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem, pub


def _scopes(publics: Sequence[tuple[Ed25519PublicKey, str | None]]) -> dict[str, frozenset[str]]:
    """key id → jobs, for keys given only with a job; a key given once without one serves
    every job (it is left out)."""
    jobs: dict[str, set[str]] = {}
    anyjob: set[str] = set()
    for k, job in publics:
        kid = key_id(k)
        if job is None:
            anyjob.add(kid)
        else:
            jobs.setdefault(kid, set()).add(job)
    return {kid: frozenset(js) for kid, js in jobs.items() if kid not in anyjob}


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc


def _mac(cipher: Cipher, payload: bytes) -> str:
    return hmac.new(cipher.mac_key, payload, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class ImageKeys:
    """The keys a process holds for images, built once from :class:`ImageSettings`: the
    encryption key (``cipher``), the fleet's signing key (agents) and the public keys it
    trusts (restoring hosts; a signer trusts its own)."""

    cipher: Cipher | None = None
    signer: Signer | None = None
    trusted: Mapping[str, Ed25519PublicKey] = field(default_factory=dict)
    allow_rollback: bool = False
    #: key id → the jobs it may authenticate; a trusted key absent here serves every job
    scopes: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, s: ImageSettings) -> ImageKeys:
        secret = s.encryption_key.get_secret_value() if s.encryption_key else None
        cipher = load_key(s.encryption_key_file, secret)
        signer: Signer | None = None
        if s.signing_key_file is not None:
            signer = parse_signing_key(
                _read(s.signing_key_file, "signing key file"), str(s.signing_key_file)
            )
        elif s.signing_key is not None:
            signer = parse_signing_key(
                s.signing_key.get_secret_value().encode(), "SPOTGUARD_SIGNING_KEY"
            )
        publics: list[tuple[Ed25519PublicKey, str | None]] = []
        if s.verify_key_file is not None:
            text = _read(s.verify_key_file, "verify key file").decode(errors="replace")
            publics += parse_scoped_verify_keys(text, str(s.verify_key_file))
        if s.verify_key:
            publics += parse_scoped_verify_keys(s.verify_key, "verify_key")
        if signer is not None and signer.key_id not in {key_id(k) for k, _ in publics}:
            publics.append((signer.public, None))  # a signer trusts its own key (unless bound)
        trusted = {key_id(k): k for k, _ in publics}
        return cls(cipher, signer, trusted, s.allow_rollback, _scopes(publics))

    def with_cipher(self, cipher: Cipher | None) -> ImageKeys:
        """These keys with another encryption key (an explicit ``cipher=`` argument)."""
        return ImageKeys(cipher, self.signer, self.trusted, self.allow_rollback, self.scopes)

    @property
    def required(self) -> bool:
        """Whether this host refuses unauthenticated images (it holds a key)."""
        return bool(self.trusted) or self.cipher is not None

    def sign(self, raw: Mapping[str, Any], encrypted: bool) -> list[Signature]:
        """The ``auth`` entries for a manifest (``raw`` without them): a signature with the
        signing key, and a MAC when the image is encrypted."""
        payload = canonical(raw)
        out: list[Signature] = []
        if self.signer is not None:
            out.append(self.signer.sign(payload))
        if encrypted and self.cipher is not None:
            out.append(
                Signature(alg=HMAC, key_id=self.cipher.key_id, sig=_mac(self.cipher, payload))
            )
        return out

    def authenticate(self, raw: Mapping[str, Any], m: Manifest, where: str) -> str:
        """Check the manifest against this host's keys: the authenticator that passed
        (``ed25519:<key id>`` / ``hmac-sha256:<key id>``), or ``""`` on a host without keys.
        Raises an :class:`~spotguard.errors.ImageUntrusted` naming what failed."""
        if self.cipher is not None and m.encryption is None:
            raise UnsignedImage(
                f"image {where} is not encrypted, but this host holds an encryption key: a "
                "plaintext image is refused (anyone with write access to the store can make one)"
            )
        payload = canonical(raw)
        if self.trusted:
            return self._signature(m.auth, payload, where, m.job)
        if self.cipher is not None:
            return self._mac(m.auth, payload, where)
        return ""

    def _for_job(self, kid: str, job: str) -> bool:
        """Whether trusted key ``kid`` may authenticate an image of ``job``."""
        scope = self.scopes.get(kid)
        return scope is None or job in scope

    def _signature(self, auth: Sequence[Signature], payload: bytes, where: str, job: str) -> str:
        ids = ", ".join(sorted(self.trusted))
        sigs = [a for a in auth if a.alg == ED25519]
        if not sigs:
            raise UnsignedImage(
                f"image {where} is not signed; this host restores only images signed by key {ids}"
            )
        known = [a for a in sigs if a.key_id in self.trusted and self._for_job(a.key_id, job)]
        other = [a for a in sigs if a.key_id in self.trusted and a not in known]
        if not known and other:
            k = other[0].key_id
            raise UntrustedSigner(
                f"image {where} of job {job!r} is signed by key {k}, which this host trusts "
                f"only for job(s) {', '.join(sorted(self.scopes[k]))}: another job's key"
            )
        if not known:
            by = ", ".join(a.key_id for a in sigs)
            raise UntrustedSigner(
                f"image {where} is signed by key {by}, which this host does not trust "
                f"(it trusts {ids})"
            )
        for a in known:
            try:
                sig = base64.b64decode(a.sig, validate=True)
            except (binascii.Error, ValueError):
                sig = b""
            if len(sig) != SIG_BYTES:
                raise BadSignature(
                    f"signature of image {where} by key {a.key_id} is truncated or malformed "
                    f"({len(sig)} bytes, not {SIG_BYTES})"
                )
            try:
                self.trusted[a.key_id].verify(sig, payload)
            except InvalidSignature as exc:
                raise BadSignature(
                    f"signature of image {where} by key {a.key_id} does not match its manifest: "
                    "altered after signing (meta, files, chunk hashes, id or sequence)"
                ) from exc
        return f"{ED25519}:{known[0].key_id}"

    def _mac(self, auth: Sequence[Signature], payload: bytes, where: str) -> str:
        assert self.cipher is not None
        macs = [a for a in auth if a.alg == HMAC and a.key_id == self.cipher.key_id]
        if not macs:
            raise UnsignedImage(
                f"image {where} carries no MAC under encryption key {self.cipher.key_id}: "
                "not authenticated (altered, or written by a build without authentication)"
            )
        if not hmac.compare_digest(macs[0].sig, _mac(self.cipher, payload)):
            raise BadSignature(
                f"MAC of image {where} under key {self.cipher.key_id} does not match its "
                "manifest: altered after it was written (meta, files, chunk hashes, id or sequence)"
            )
        return f"{HMAC}:{self.cipher.key_id}"
