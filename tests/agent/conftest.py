"""Agent test fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_helpers import EventSink


@pytest.fixture
def sink() -> Iterator[EventSink]:
    s = EventSink().start()
    try:
        yield s
    finally:
        s.stop()
