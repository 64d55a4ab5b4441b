"""Settings of ``spotguard metadata-sim`` (config section ``[metadata_sim]``, environment
``SPOTGUARD_SIM_<NAME>``): where it listens, which clouds it serves, the instance it claims to
be and how strict its IMDSv2 tokens are."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from spotguard.config import Settings
from spotguard.simulator.state import CLOUDS


class SimSettings(Settings):
    """How the metadata emulator runs."""

    section: ClassVar[str] = "metadata_sim"
    model_config = SettingsConfigDict(
        env_prefix="SPOTGUARD_SIM_", extra="forbid", frozen=True, validate_default=True
    )

    host: str = Field("127.0.0.1", description="Address to listen on")
    port: int = Field(1338, ge=0, le=65535, description="Port to listen on (0 = any free port)")
    clouds: str = Field(
        ",".join(CLOUDS), description="Comma-separated clouds to serve (aws, gcp, azure)"
    )
    instance_id: str = Field("i-0123456789abcdef0", description="Instance id to report")
    instance_type: str = Field("g5.xlarge", description="Instance / machine type / VM size")
    zone: str = Field("us-east-1a", description="Availability zone to report")
    region: str | None = Field(None, description="Region to report (default: from the zone)")
    spot: bool = Field(True, description="Report a spot / preemptible instance")
    user_data: str | None = Field(None, description="User-data to serve (@FILE reads a file)")
    attribute: list[str] = Field(
        default_factory=list, description="GCP instance attribute KEY=VALUE (repeatable)"
    )
    max_token_ttl: int | None = Field(
        None, ge=1, le=21600, description="Cap on IMDSv2 token lifetimes, in seconds"
    )
    imdsv1: bool = Field(False, description="Answer AWS requests that carry no token (IMDSv1)")

    @field_validator("clouds")
    @classmethod
    def _known_clouds(cls, value: str) -> str:
        names = [c.strip() for c in value.split(",") if c.strip()]
        bad = [c for c in names if c not in CLOUDS]
        if bad or not names:
            raise ValueError(f"clouds must be some of {', '.join(CLOUDS)}, got {value!r}")
        return ",".join(names)

    @field_validator("attribute")
    @classmethod
    def _pairs(cls, value: list[str]) -> list[str]:
        for item in value:
            if "=" not in item or not item.split("=", 1)[0]:
                raise ValueError(f"attribute must be KEY=VALUE, got {item!r}")
        return value
