"""Controller settings (``[controller]`` in the config file) and the CLI client's (``[cli]``).

Secrets (the admin token, the VM-token key) are read from files or the environment; a token
on the command line is visible to every user in ``ps`` (see docs/security.md).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field, field_validator

from spotguard.config import Settings, check_http_url, not_text
from spotguard.errors import ConfigError
from spotguard.store import check_url

if TYPE_CHECKING:
    import ssl

    from spotguard.contracts import KeySources
    from spotguard.controller.retention import EventRetention
    from spotguard.controller.tokens import TokenKeys


class ControllerSettings(Settings):
    """How the controller listens, keeps state, launches and recovers."""

    section: ClassVar[str] = "controller"
    listen: str = Field("127.0.0.1:8700", description="HOST:PORT the agent API listens on")
    state_dir: Path = Field(
        Path("/var/lib/spotguard"),
        description="Directory of the controller's state (the systemd unit sets its own)",
    )
    state: Path | None = Field(
        None, description="SQLite state file [default: STATE_DIR/controller.db]"
    )
    init_state: bool = Field(
        False,
        description="Initialise the state file when it exists but is empty (0 bytes); "
        "without it such a file is refused at start, so no job is forgotten silently",
    )
    provider: Literal["aws", "gcp", "local"] = Field(
        "local", description="Where new instances come from"
    )
    strategy: str = Field("same-zone-first", description="Recovery strategy (registry name)")
    controller_token: str | None = Field(
        None, description="Admin bearer token (operators, CLI); never sent to VMs"
    )
    controller_token_file: Path | None = Field(
        None, description="File holding the admin token (instead of controller_token)"
    )
    vm_token_key_file: Path | None = Field(
        None,
        description="File holding the key VM tokens are signed with [default: derived from "
        "the admin token]",
    )
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (chain): serve HTTPS with it"
    )
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file")
    insecure_listen: bool = Field(
        False,
        description="Allow plain HTTP on a non-loopback address (only behind a TLS proxy "
        "or on a private network you trust)",
    )
    advertise_url: str | None = Field(
        None, description="Controller URL new instances report to [default: http://LISTEN]"
    )
    default_store: str | None = Field(
        None, description="Image store URL for jobs whose agent names none"
    )
    max_restarts: int = Field(
        5,
        ge=0,
        le=1000,
        description="Relaunch rounds in a row that do not restore a job before it is FAILED "
        "(each successful restore resets the count; 'jobs retry' opens a new budget)",
    )
    notice_grace_s: float = Field(
        60.0, ge=0, description="Seconds past a notice's deadline before using the newest image"
    )
    default_notice_s: float = Field(
        120.0, gt=0, description="Deadline assumed for a notice that carries none"
    )
    ready_timeout_s: float = Field(600.0, gt=0, description="Seconds for a launch to run")
    restore_timeout_s: float = Field(
        900.0, gt=0, description="Seconds for the new instance's agent to report restored"
    )
    on_demand_fallback: bool = Field(True, description="Try on-demand after every spot offer")
    terminate_old: bool = Field(
        True, description="Terminate the old instance once its image is durable and it let go"
    )
    terminate_finished: bool = Field(
        True, description="Terminate the instance the controller launched once its job finished"
    )
    liveness_s: float = Field(
        15.0, gt=0, description="Seconds between checks that an instance being restored exists"
    )
    types_per_zone: int = Field(1, ge=1, description="Instance types tried per zone and market")
    max_candidates: int = Field(24, ge=1, description="Launch attempts per relaunch round")
    capacity_retry_s: float = Field(
        60.0, ge=0, description="Wait after every candidate lacked capacity"
    )
    capacity_rounds: int = Field(
        3, ge=1, description="Passes over all candidates before giving up for lack of capacity"
    )
    tick_s: float = Field(1.0, gt=0, description="Reconcile loop wake-up interval")
    vm_signing_key_source: str | None = Field(
        None,
        description="Key source of the fleet's image signing key, handed to every VM the "
        "controller launches (spotguard fetch-keys; a name, never the key)",
    )
    vm_verify_key_source: str | None = Field(
        None, description="Key source of the fleet's public verify key, handed to every VM"
    )
    vm_signing_key_sources: dict[str, str] = Field(
        default_factory=dict,
        description="Key source of each job's own signing key (job → source), handed to the "
        "VMs of that job only; a job not named gets vm_signing_key_source",
    )
    vm_verify_key_sources: dict[str, str] = Field(
        default_factory=dict,
        description="Key source of each job's verify key(s) (job → source); a job not named "
        "gets vm_verify_key_source",
    )
    events_keep: int = Field(
        1000,
        ge=10,
        description="Newest agent event ids the state remembers per job (a retried report is "
        "applied once); older ones are forgotten",
    )
    events_keep_bytes: int = Field(
        4 << 20,
        ge=0,
        description="Bytes of agent event bodies the state keeps per job, newest first; older "
        "events keep their id without their body",
    )
    events_keep_days: float = Field(
        30.0, gt=0, description="Days after which an agent event is deleted from the state"
    )

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url(cls, v: str | None) -> str | None:
        """What every relaunched VM is told to report to: refused at start, not by each VM."""
        if v is None:
            return None
        try:
            return check_http_url(v, "advertise_url")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @field_validator("default_store")
    @classmethod
    def _default_store(cls, v: str | None) -> str | None:
        """Where jobs that name no store are restored from: checked as a store URL now (scheme,
        bucket), not when a relaunched VM first tries to open it."""
        if v is None:
            return None
        try:
            check_url(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        return v

    def token(self) -> str:
        """The bearer token; a controller without one refuses to start."""
        if self.controller_token:
            return self.controller_token
        if self.controller_token_file:
            try:
                tok = self.controller_token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"token file {self.controller_token_file}: {exc}") from exc
            except UnicodeDecodeError as exc:
                raise ConfigError(
                    f"token file {self.controller_token_file}: {not_text(exc)}"
                ) from exc
            if tok:
                return tok
        raise ConfigError(
            "the controller needs a token (its admin token): --controller-token-file, "
            "SPOTGUARD_CONTROLLER_TOKEN_FILE or SPOTGUARD_CONTROLLER_TOKEN"
        )

    def vm_key_sources(self, job: str) -> KeySources | None:
        """Where a VM of ``job`` fetches its image keys (None: the fleet has none): the
        job's own sources, else the fleet's."""
        from spotguard.contracts import KeySources

        signing = self.vm_signing_key_sources.get(job, self.vm_signing_key_source)
        verify = self.vm_verify_key_sources.get(job, self.vm_verify_key_source)
        if signing is None and verify is None:
            return None
        return KeySources(signing_key=signing, verify_key=verify)

    def event_retention(self) -> EventRetention:
        """How much of each job's event log the state keeps (the ``events_keep*`` settings)."""
        from spotguard.controller.retention import EventRetention

        return EventRetention(self.events_keep, self.events_keep_bytes, self.events_keep_days)

    def state_path(self) -> Path:
        """The SQLite file: ``state``, else ``controller.db`` in ``state_dir`` (so the unit's
        ``SPOTGUARD_STATE_DIR`` — its StateDirectory — holds it)."""
        return self.state if self.state is not None else self.state_dir / "controller.db"

    def token_keys(self) -> TokenKeys:
        """Verifier of admin and VM tokens (the VM-token key from its file, if set)."""
        from spotguard.controller.tokens import TokenKeys

        key: bytes | None = None
        if self.vm_token_key_file is not None:
            try:
                key = self.vm_token_key_file.read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"vm_token_key_file {self.vm_token_key_file}: {exc}") from exc
            if len(key) < 32:
                raise ConfigError(
                    f"vm_token_key_file {self.vm_token_key_file} holds {len(key)} bytes; "
                    "use at least 32 (e.g. openssl rand -hex 32)"
                )
        return TokenKeys(self.token(), key)

    def tls(self) -> ssl.SSLContext | None:
        """The server's TLS context (None: plain HTTP). Refuses plain HTTP on a
        non-loopback address unless ``insecure_listen`` says so."""
        import ssl

        cert, key = self.tls_cert_file, self.tls_key_file
        if cert is None and key is None:
            host, _ = self.host_port()
            if not _loopback(host) and not self.insecure_listen:
                raise ConfigError(
                    f"listen {self.listen} is not a loopback address and no TLS certificate is "
                    "set: agents' tokens would cross the network in clear. Set tls_cert_file "
                    "and tls_key_file (--tls-cert-file/--tls-key-file), or put the controller "
                    "behind a TLS proxy and pass --insecure-listen"
                )
            return None
        if cert is None or key is None:
            raise ConfigError("tls_cert_file and tls_key_file must be set together")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        for path in (cert, key):
            _check_pem(path)
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"TLS certificate {cert} / key {key} unusable: {exc}") from exc
        return ctx

    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        try:
            return host or "127.0.0.1", int(port)
        except ValueError:
            raise ConfigError(f"listen must be HOST:PORT, got {self.listen!r}") from None

    def public_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host, port = self.host_port()
        scheme = "https" if self.tls_cert_file else "http"
        return f"{scheme}://{host}:{port}"


def _check_pem(path: Path) -> None:
    """A TLS file that holds no PEM block (absent, or the systemd unit's placeholder for a
    missing credential): one line naming where the file goes."""
    try:
        head = path.read_bytes()[: 1 << 16]
    except OSError as exc:
        raise ConfigError(f"TLS file {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN " not in head:
        raise ConfigError(
            f"TLS file {path} holds no PEM data: put the certificate and key in "
            "/etc/spotguard/controller.crt and /etc/spotguard/controller.key (the "
            "spotguard-controller unit loads them as credentials), or run in private-network "
            "mode with insecure_listen = true (--insecure-listen)"
        )


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ClientSettings(Settings):
    """Where ``spotguard jobs`` / ``migrate`` find the controller."""

    section: ClassVar[str] = "cli"
    controller_url: str = Field("http://127.0.0.1:8700", description="Controller API base URL")
    controller_token: str | None = Field(None, description="Admin token for the controller")
    controller_token_file: Path | None = Field(
        None, description="File holding the admin token (instead of controller_token)"
    )
    controller_ca_file: Path | None = Field(
        None, description="PEM CA bundle that signed the controller's certificate"
    )

    @field_validator("controller_url")
    @classmethod
    def _controller_url(cls, v: str) -> str:
        """Refused here, not met later as "unreachable (garbage/v1/jobs)"."""
        try:
            return check_http_url(v, "controller URL")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    def bearer(self) -> str | None:
        """The admin token, inline or from its file."""
        if self.controller_token:
            return self.controller_token
        if self.controller_token_file is None:
            return None
        try:
            return self.controller_token_file.read_text().strip() or None
        except OSError as exc:
            raise ConfigError(f"token file {self.controller_token_file}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"token file {self.controller_token_file}: {not_text(exc)}") from exc
