"""Settings of the notice sources (config section ``[notices]``).

Each setting is defined once here; :func:`spotguard.config.options` turns it into a flag and the
environment variable ``SPOTGUARD_NOTICES_<NAME>``. The metadata endpoints themselves follow the
conventions of each cloud's own SDK (see :mod:`spotguard.notices.endpoints`), so a process
pointed at an emulator for boto3 or google-auth is pointed at it for spotguard too.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from spotguard.config import Settings


class NoticeSettings(Settings):
    """How the notice sources poll their metadata services."""

    section: ClassVar[str] = "notices"
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_NOTICES_", extra="forbid", frozen=True, validate_default=True
    )

    cloud: Literal["auto", "aws", "gcp", "azure", "none"] = Field(
        "auto",
        description=(
            "Which cloud's metadata service to watch (auto = detect; none = no metadata "
            "source: operator drains and periodic checkpoints only)"
        ),
    )
    poll_interval: float = Field(
        1.0, gt=0, le=60, description="Seconds between polls (AWS IMDS, Azure Scheduled Events)"
    )
    imdsv1: bool = Field(
        False, description="Allow falling back to AWS IMDSv1 (no token) when IMDSv2 is refused"
    )
    token_ttl: int = Field(
        21600, ge=1, le=21600, description="AWS IMDSv2 token lifetime to ask for, in seconds"
    )
    timeout: float = Field(
        2.0, gt=0, description="Seconds one metadata request may take before it counts as failed"
    )
    long_poll: int = Field(
        60, ge=1, le=3600, description="GCP long-poll wait per request (timeout_sec), in seconds"
    )
    detect_timeout: float = Field(
        0.3, gt=0, description="Seconds each metadata service gets to answer cloud detection"
    )
    backoff_max: float = Field(
        10.0, gt=0, description="Longest wait, in seconds, before a failed source is restarted"
    )
