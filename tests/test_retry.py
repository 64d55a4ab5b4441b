"""The one retry helper (:mod:`spotguard.retry`): what is retried, how long it waits, when it
gives up, and what the hook is told."""

from __future__ import annotations

import asyncio

import pytest

from spotguard.retry import Retry, RetryPolicy, call, call_blocking, sparse

FAST = RetryPolicy(attempts=4, initial=0.001, maximum=0.004, jitter=0)


class Flaky:
    """Fails with ``exc`` the first ``fails`` times, then answers ``ok``."""

    def __init__(self, fails: int, exc: Exception) -> None:
        self.fails, self.exc, self.calls = fails, exc, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.fails:
            raise self.exc
        return "ok"


def test_transient_failures_are_retried_and_the_hook_sees_each() -> None:
    flaky = Flaky(2, ConnectionError("down"))
    seen: list[Retry] = []

    async def fn() -> str:
        return flaky()

    assert asyncio.run(call(fn, FAST, ConnectionError, on_retry=seen.append)) == "ok"
    assert flaky.calls == 3
    assert [(r.attempt, str(r.error), r.wait) for r in seen] == [
        (1, "down", 0.001),
        (2, "down", 0.002),
    ]


def test_the_last_error_is_raised_when_attempts_run_out() -> None:
    flaky = Flaky(10, ConnectionError("still down"))

    async def fn() -> str:
        return flaky()

    with pytest.raises(ConnectionError, match="still down"):
        asyncio.run(call(fn, FAST, ConnectionError))
    assert flaky.calls == 4


def test_an_error_not_retried_is_raised_at_once() -> None:
    flaky = Flaky(1, ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        call_blocking(flaky, FAST, lambda e: isinstance(e, ConnectionError))
    assert flaky.calls == 1


def test_a_bound_in_seconds_stops_before_a_wait_past_it() -> None:
    """Waits 1, 2, 4 … with a 4 s bound: the waits that fit are taken (and slept by the
    given ``sleep``), the next one that would end past the bound is not."""
    flaky = Flaky(100, ConnectionError("down"))
    slept: list[float] = []
    policy = RetryPolicy(attempts=None, initial=1.0, maximum=15.0, jitter=0, within=4.0)
    with pytest.raises(ConnectionError):
        call_blocking(flaky, policy, ConnectionError, sleep=slept.append)
    assert slept == [1.0, 2.0]
    assert flaky.calls == 3


def test_sparse_logs_the_first_fifth_and_every_twentieth() -> None:
    assert [n for n in range(1, 61) if sparse(n)] == [1, 5, 20, 40, 60]
