"""Controller settings (``[controller]`` in the config file) and the CLI client's (``[cli]``)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from spotguard.config import Settings
from spotguard.errors import ConfigError


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
    provider: Literal["aws", "gcp", "local"] = Field(
        "local", description="Where new instances come from"
    )
    strategy: str = Field("same-zone-first", description="Recovery strategy (registry name)")
    controller_token: str | None = Field(
        None, description="Bearer token agents and the CLI must send"
    )
    controller_token_file: Path | None = Field(
        None, description="File holding the bearer token (instead of controller_token)"
    )
    advertise_url: str | None = Field(
        None, description="Controller URL new instances report to [default: http://LISTEN]"
    )
    default_store: str | None = Field(
        None, description="Image store URL for jobs whose agent names none"
    )
    max_restarts: int = Field(5, ge=0, description="Relaunches per job before giving up")
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

    def token(self) -> str:
        """The bearer token; a controller without one refuses to start."""
        if self.controller_token:
            return self.controller_token
        if self.controller_token_file:
            try:
                tok = self.controller_token_file.read_text().strip()
            except OSError as exc:
                raise ConfigError(f"token file {self.controller_token_file}: {exc}") from exc
            if tok:
                return tok
        raise ConfigError(
            "the controller needs a token: --token, SPOTGUARD_CONTROLLER_TOKEN or "
            "--controller-token-file"
        )

    def state_path(self) -> Path:
        """The SQLite file: ``state``, else ``controller.db`` in ``state_dir`` (so the unit's
        ``SPOTGUARD_STATE_DIR`` — its StateDirectory — holds it)."""
        return self.state if self.state is not None else self.state_dir / "controller.db"

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
        return f"http://{host}:{port}"


class ClientSettings(Settings):
    """Where ``spotguard jobs`` / ``migrate`` find the controller."""

    section: ClassVar[str] = "cli"
    controller_url: str = Field("http://127.0.0.1:8700", description="Controller API base URL")
    controller_token: str | None = Field(None, description="Bearer token for the controller")
