"""The base of spotguard's wire shapes, the bounds of their numbers, and the GPU inventory's
shape — apart from :mod:`spotguard.contracts` (which re-exports them all).

Why apart: the checkpoint path (a GPU group's messages, a container's spec) needs these few,
and building the controller's ~50 event and directive models at import cost
``spotguard checkpoint`` ~50 ms of the time it spends before the freeze (issue 25, item 5;
``bench/cli_wall.py``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

#: Bounds of the numbers on the wire, checked where a report is parsed (the controller's
#: edge): no agent sends more, and a larger one (1e308, an integer SQLite cannot hold) is a
#: 400, never a 500 nor a value stored in a job's record. inf and NaN are refused by
#: :class:`Wire` itself.
MAX_SECONDS = 1e9  # about 31 years: a duration, or a wall-clock time in seconds
MAX_BYTES = 1 << 60  # 1 EiB
MAX_COUNT = (1 << 31) - 1  # pids, attempts, epochs, GPU indices and counts, versions
Seconds = Annotated[float, Field(ge=-MAX_SECONDS, le=MAX_SECONDS)]
Timestamp = Annotated[float, Field(ge=0, le=100 * MAX_SECONDS)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]


class Wire(BaseModel):
    """Base of every shape on the wire: unknown fields are refused, so are inf and NaN."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GpuDeviceInfo(Wire):
    index: Count
    uuid: str
    model: str
    memory_total: Bytes


class GpuInfo(Wire):
    """:class:`spotguard.facts.GpuInventory` on the wire."""

    model: str | None = None
    count: Count = 0
    driver: str | None = None
    devices: list[GpuDeviceInfo] = Field(default_factory=list)
