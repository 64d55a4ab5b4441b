"""What ``GET /v1/jobs/{job}`` answers (:class:`JobView`): built by the API
(:mod:`spotguard.controller.api`) from the controller's snapshot of the job, read by the client
(:meth:`spotguard.controller.client.ControllerClient.job`) and shown by ``spotguard jobs show``.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, JsonValue

from spotguard.contracts import Owner, Wire
from spotguard.lifecycle import JobState


class HistoryRow(Wire):
    """One transition (or note) of the job: when, from which state to which, why."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    at: float
    from_state: str | None = Field(default=None, alias="from")
    to: str
    reason: str = ""
    detail: dict[str, JsonValue] = Field(default_factory=dict)


class ImageRow(Wire):
    """A durable image reported for the job."""

    image_url: str
    at: float
    bytes: int | None = None


class JobView(Wire):
    """One job as the controller shows it: its record (state, reason, newest image, current
    and pending instance, launch round, restarts), its owner, history timeline and images."""

    name: str
    state: JobState
    reason: str = ""
    store: str | None = None
    image_url: str | None = None
    spec: dict[str, JsonValue] = Field(default_factory=dict)
    instance: dict[str, JsonValue] = Field(default_factory=dict)
    pending: dict[str, JsonValue] | None = None
    launch_token: str | None = None
    launch_attempt: int = 0
    restarts: int = 0
    deadline: float | None = None
    data: dict[str, JsonValue] = Field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    since: float = 0.0
    owner: Owner = Field(default_factory=Owner)
    history: list[HistoryRow] = Field(default_factory=list)
    images: list[ImageRow] = Field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The wire form (``from`` spelt as on the wire)."""
        return self.model_dump(mode="json", by_alias=True)
