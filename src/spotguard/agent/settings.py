"""The agent's settings: one definition each → ``[agent]`` key, ``SPOTGUARD_*`` env, ``--flag``.

Settings shared with other parts are defined by those parts and combined by ``spotguard agent``:
the state directory and engine limits (:class:`~spotguard.checkpoint.settings.CheckpointSettings`),
the cloud and polling (:class:`~spotguard.notices.settings.NoticeSettings`). This class holds only
what is the agent's own.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from spotguard.config import Settings, http_host, not_text
from spotguard.container.spec import ContainerRef, is_container_job
from spotguard.contracts import ASSIGNMENT_PATH
from spotguard.errors import ConfigError, JobError
from spotguard.names import check_job_name
from spotguard.notices.base import NoticeKind
from spotguard.warm import parse_setting

from .jobspec import by_name
from .policy import Action, Policy

DEFAULT_LISTEN = "127.0.0.1:9901"

log = logging.getLogger(__name__)

#: logged once per process when the controller token is written in the config file
INLINE_TOKEN_WARNING = (
    "controller token given inline in the config file, which may be readable by others: "
    "use controller_token_file (--controller-token-file, SPOTGUARD_CONTROLLER_TOKEN_FILE) "
    "or SPOTGUARD_CONTROLLER_TOKEN instead"
)
_warned_inline_token = False

#: The longest deadline an operator drain may have (``drain --deadline``, the API's
#: ``deadline_s``, ``drain_deadline``): a day; more is a mistake, not a plan.
DRAIN_DEADLINE_MAX = 86400.0


class AgentSettings(Settings):
    """``[agent]``: which jobs to protect, where images go, whom to tell, how to react."""

    section: ClassVar[str] = "agent"

    job: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description=(
            "Job(s) to protect: a pid, a job name from 'spotguard run', a cgroup path or a "
            "container, podman:NAME (repeat the flag; comma-separated in the environment)"
        ),
    )
    store: str = Field(
        "file:///var/lib/spotguard/images",
        description="Image store URL (s3://bucket/prefix, gs://bucket/prefix, file:///dir)",
    )
    discover_jobs: bool = Field(
        True,
        description="Also protect every job 'spotguard run' starts in the state dir (a job "
        "run with --no-protect excepted), without naming it in job",
    )
    discover_interval_s: float = Field(
        2.0, gt=0, description="Seconds between looks for new 'spotguard run' jobs"
    )
    insecure_controller: bool = Field(
        False,
        description="Allow a plain http:// controller_url off this host: the controller's "
        "private-network mode (insecure_listen), on a network you trust; the token and "
        "events cross it in clear",
    )
    controller_url: str | None = Field(
        None,
        description="Controller to report to (optional: the agent works alone); https://, "
        "or http:// only to a loopback address (or with insecure_controller)",
    )
    controller_token: str | None = Field(
        None,
        description="Bearer token for the controller: in the config file or "
        "SPOTGUARD_CONTROLLER_TOKEN (never a flag: ps shows flags); prefer controller_token_file",
    )
    controller_token_file: Path | None = Field(
        None, description="File holding the controller token (instead of controller_token)"
    )
    api_listen: str = Field(
        DEFAULT_LISTEN, description="Local API address: HOST:PORT (loopback) or unix:/path"
    )
    api_token: str | None = Field(
        None,
        description="Token for the local API (default: generated into the state dir)",
    )
    api_token_file: Path | None = Field(None, description="File holding the local API token")
    periodic_interval: float = Field(
        0.0, ge=0, description="Seconds between periodic checkpoints (0 = off)"
    )
    policy_preempt: Action = Field(
        Action.EXIT, description="Action on spot terminate / GCP preempt / Azure Preempt"
    )
    policy_rebalance: Action = Field(
        Action.RESUME, description="Action on a rebalance recommendation"
    )
    policy_maintenance: Action = Field(
        Action.EXIT, description="Action on scheduled maintenance (exit or resume to stay)"
    )
    policy_drain: Action = Field(Action.EXIT, description="Action on an operator drain")
    maintenance_live: Action = Field(
        Action.NONE,
        description="Action on live maintenance (GCP MIGRATE_ON_HOST_MAINTENANCE, Azure Freeze)",
    )
    maintenance_lead: float = Field(
        300.0, ge=0, description="Seconds before a maintenance deadline to start the checkpoint"
    )
    drain_deadline: float = Field(
        120.0,
        gt=0,
        le=DRAIN_DEADLINE_MAX,
        description="Deadline in seconds given to an operator drain",
    )
    assignment: Path = Field(
        Path(ASSIGNMENT_PATH), description="Assignment file read at start (restore this image)"
    )
    exit_when_done: bool = Field(
        False, description="Stop the agent once every protected job has exited"
    )
    directive_poll_s: float = Field(
        10.0,
        ge=0,
        description=(
            "Seconds between asking the controller what it wants from each protected job "
            "(GET /v1/jobs/{job}/directive; 0 = off)"
        ),
    )
    push_retry_max_s: float = Field(
        60.0,
        gt=0,
        description=(
            "Longest wait, in seconds, between attempts to push a kept staged image "
            "(exit mode, store unreachable) until it is durable"
        ),
    )
    job_lock_dir: Path = Field(
        Path("/run/spotguard/jobs"),
        description=(
            "Where the agents of this machine lock the jobs they protect (one agent per job "
            "across state dirs); a directory in memory, root's only. Machines simulated on "
            "one host (the local provider's VMs) each have their own, as real VMs do"
        ),
    )

    transparent_hugepages: Literal["always", "madvise", "never", "keep"] = Field(
        "always",
        description=(
            "The host's transparent huge page mode, set at agent start: 'always' makes the "
            "driver's GPU checkpoint and CRIU's restore page-in faster (docs/limits.md); "
            "'keep' leaves it as the VM came"
        ),
    )

    warm_memory: str = Field(
        "auto",
        description=(
            "Touch the host's free memory once at start (after the boot restore), so the "
            "first freeze does not pay the VM's first touch of its memory: 'auto' (on a host "
            "with an NVIDIA GPU: all but a tenth, at least 8 GiB), 'off', or GiB at most "
            "(spotguard.warm)"
        ),
    )

    @field_validator("warm_memory")
    @classmethod
    def _warm_memory(cls, v: str) -> str:
        try:
            parse_setting(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        return v

    @field_validator("job", mode="before")
    @classmethod
    def _split_jobs(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [p.strip() for p in v.split(",") if p.strip()]
        if isinstance(v, tuple):
            v = list(v)
        for job in v if isinstance(v, list) else []:
            if isinstance(job, str) and is_container_job(job.strip()):
                try:
                    ContainerRef.parse(job.strip())  # docker:/containerd: or a bad name
                except JobError as exc:
                    raise ValueError(str(exc)) from exc
            elif isinstance(job, str) and by_name(job):
                check_job_name(job.strip())  # else the agent waits forever for "../x"
        return v

    @field_validator("controller_url")
    @classmethod
    def _controller_url(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v:  # insecure_controller is declared first: validated before this one
            try:
                check_controller_url(v, insecure=bool(info.data.get("insecure_controller")))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return v

    @model_validator(mode="after")
    def _inline_token(self) -> Self:
        """A token from the config file (not the environment) is logged once."""
        global _warned_inline_token
        from_env = os.environ.get(self.env_name("controller_token"))
        if self.controller_token and self.controller_token != from_env and not _warned_inline_token:
            _warned_inline_token = True
            log.warning(INLINE_TOKEN_WARNING)
        return self

    @field_validator("api_listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_listen(v)
        return v

    def policy(self) -> Policy:
        """The :class:`Policy` these settings describe."""
        return Policy(
            {
                NoticeKind.PREEMPT: self.policy_preempt,
                NoticeKind.REBALANCE: self.policy_rebalance,
                NoticeKind.MAINTENANCE: self.policy_maintenance,
                NoticeKind.DRAIN: self.policy_drain,
            },
            maintenance_live=self.maintenance_live,
            maintenance_lead_s=self.maintenance_lead,
        )

    def controller_bearer(self) -> str | None:
        """The controller token, from the setting or its file."""
        return read_secret(self.controller_token, self.controller_token_file, "controller_token")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_controller_url(url: str, *, insecure: bool = False) -> str:
    """``url`` if an agent may send its token there, else :class:`ConfigError`: https to any
    host, plain http only to this host (a loopback address) unless ``insecure`` (the
    operator's explicit private-network opt-in, ``insecure_controller``). Plain http across a
    network hands the bearer token (and every event) to whoever can watch the traffic."""
    found = http_host(url)
    if found is None:
        raise ConfigError(
            f"controller URL {url!r} is not an http(s) URL: use https://HOST[:PORT] "
            "(http:// only to a loopback address)"
        )
    scheme, host = found
    if scheme == "http" and not _loopback(host) and not insecure:
        raise ConfigError(
            f"controller URL {url} is plain HTTP to {host}, not this host: the agent's token "
            "and events would cross the network in clear; use https:// (the controller's "
            "--tls-cert-file, or a TLS proxy in front of it), a loopback address, or on a "
            "private network you trust insecure_controller = true "
            "(SPOTGUARD_INSECURE_CONTROLLER=1)"
        )
    return url


def read_secret(value: str | None, path: Path | None, name: str) -> str | None:
    """A secret given inline or as a file (file wins only when no inline value is set)."""
    if value:
        return value
    if path is None:
        return None
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{name}_file {path} cannot be read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{name}_file {path}: {not_text(exc)}") from exc
    return text or None


def parse_listen(listen: str) -> tuple[str, int] | Path:
    """``HOST:PORT`` → (host, port); ``unix:/path`` → Path. Only loopback hosts are allowed:
    the API can freeze jobs."""
    if listen.startswith("unix:"):
        path = listen[5:]
        if not path.startswith("/"):
            raise ValueError(f"unix socket path must be absolute: {listen!r}")
        return Path(path)
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"api_listen must be HOST:PORT or unix:/path, got {listen!r}")
    host = host.strip("[]")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"api_listen must be a loopback address, got {host!r}")
    return host, int(port)
