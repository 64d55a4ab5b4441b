"""Retries, written once: a :class:`RetryPolicy` and :func:`call` / :func:`call_blocking`,
which run a call and retry the failures a predicate calls transient (tenacity underneath).

Why one place: the store's calls, the kept-image pusher, the event reporter and the key fetch
each retried in their own way. Here they share one backoff (``initial`` seconds doubling up to
``maximum``, plus up to ``jitter`` seconds at random), one bound (``attempts`` tries in all,
``within`` seconds in all, or neither: until it succeeds or the task is cancelled) and one
hook, ``on_retry(Retry)``, called before each wait, where each caller logs and counts in its
own words (:func:`sparse` thins the lines of a loop that retries for ever).

The first attempt runs bare, outside tenacity: building its machinery for every call cost more
CPU than a store call itself on a fast store (two or three per image chunk). A failure the
predicate retries then enters the loop as its attempt 1, with the same backoff and hook.
(Under a ``within`` bound every attempt runs in the loop, so the bound counts from the first.)

Not here: :class:`spotguard.notices.backoff.Backoff`, the delay between restarts of a
long-running notice source (it counts failures across runs and is reset by a success; there is
no single call to retry).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_any,
    stop_before_delay,
    stop_never,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

T = TypeVar("T")

RetryOn = type[BaseException] | tuple[type[BaseException], ...] | Callable[[BaseException], bool]
"""What is retried: exception types, or a predicate on the exception."""


@dataclass(frozen=True)
class RetryPolicy:
    """How transient errors are retried: ``attempts`` tries in all (``None``: no limit),
    waiting ``initial`` seconds doubling up to ``maximum`` with up to ``jitter`` seconds of
    jitter; ``within``: no wait that would end past this many seconds after the first try.

    ``timeout`` bounds one request of a store: the seconds a backend waits to connect, and
    then for any byte of the answer (an idle connection, not the whole transfer, so a large
    object on a slow link is not cut off). A store that stops answering fails that attempt
    with :class:`~spotguard.errors.StoreUnavailable`; with the retries, a call that hangs
    returns within about ``attempts * (timeout + maximum)`` seconds, never blocks for ever.
    """

    attempts: int | None = 5
    initial: float = 0.2
    maximum: float = 5.0
    jitter: float = 0.5
    timeout: float = 30.0
    within: float | None = None


@dataclass(frozen=True)
class Retry:
    """What ``on_retry`` is told before each wait: the failed ``attempt`` (1 for the first
    try), its ``error`` and the seconds until the next try."""

    attempt: int
    error: BaseException
    wait: float


def sparse(attempt: int) -> bool:
    """Whether a loop that retries for ever logs this retry: the 1st, the 5th, every 20th."""
    return attempt in (1, 5) or attempt % 20 == 0


def _predicate(retry_on: RetryOn) -> Callable[[BaseException], bool]:
    if isinstance(retry_on, type | tuple):
        types = retry_on
        return lambda exc: isinstance(exc, types)
    return retry_on


def _stop(policy: RetryPolicy) -> stop_base:
    stops: list[stop_base] = []
    if policy.attempts is not None:
        stops.append(stop_after_attempt(max(1, policy.attempts)))
    if policy.within is not None:
        stops.append(stop_before_delay(policy.within))
    return stop_any(*stops) if stops else stop_never


def _hook(on_retry: Callable[[Retry], None] | None) -> Callable[[RetryCallState], None]:
    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        if on_retry is not None and exc is not None:
            wait = state.next_action.sleep if state.next_action else 0.0
            on_retry(Retry(state.attempt_number, exc, wait))

    return before_sleep


def _settings(
    policy: RetryPolicy,
    retry_on: Callable[[BaseException], bool],
    on_retry: Callable[[Retry], None] | None,
) -> dict[str, object]:
    return {
        "retry": retry_if_exception(retry_on),
        "stop": _stop(policy),
        "wait": wait_exponential_jitter(
            multiplier=policy.initial, max=policy.maximum, jitter=policy.jitter
        ),
        "before_sleep": _hook(on_retry),
        "reraise": True,
    }


def _replay(first: BaseException | None, fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, except that its first call raises ``first`` (the bare attempt's failure)."""
    failed = [first] if first is not None else []

    def again() -> T:
        if failed:
            raise failed.pop()
        return fn()

    return again


async def call(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    retry_on: RetryOn,
    *,
    on_retry: Callable[[Retry], None] | None = None,
) -> T:
    """``await fn()``, retried as ``policy`` says while ``retry_on`` holds for its error;
    the last error is raised as it is when the policy gives up (or one not retried, at once)."""
    pred = _predicate(retry_on)
    first: BaseException | None = None
    if policy.within is None:  # a bound in seconds counts from the first try: all in the loop
        try:
            return await fn()
        except Exception as exc:
            if not pred(exc) or policy.attempts == 1:
                raise
            first = exc
    failed = [first] if first is not None else []

    async def again() -> T:  # a coroutine function: tenacity awaits only those
        if failed:
            raise failed.pop()
        return await fn()

    retrying = AsyncRetrying(**_settings(policy, pred, on_retry))  # type: ignore[arg-type]
    return await retrying(again)


def call_blocking(
    fn: Callable[[], T],
    policy: RetryPolicy,
    retry_on: RetryOn,
    *,
    on_retry: Callable[[Retry], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """:func:`call` for a blocking ``fn`` (waits with ``sleep``); run it in a thread."""
    pred = _predicate(retry_on)
    first: BaseException | None = None
    if policy.within is None:
        try:
            return fn()
        except Exception as exc:
            if not pred(exc) or policy.attempts == 1:
                raise
            first = exc
    retrying = Retrying(sleep=sleep, **_settings(policy, pred, on_retry))  # type: ignore[arg-type]
    return retrying(_replay(first, fn))
