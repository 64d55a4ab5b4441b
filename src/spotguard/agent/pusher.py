"""Push kept staged images again until the store takes them.

An ``exit``-mode checkpoint whose upload failed has already stopped the job: its staged image
(kept by :mod:`spotguard.operations.kept`, recorded under ``{state_dir}/kept/`` before the
upload started) is the job's only state. The agent does not wait for an operator: a
:class:`KeptPusher` retries each kept image with exponential backoff
(:func:`spotguard.retry.call`, capped at ``push_retry_max_s``) until it is durable or the agent
stops — and a restarted agent finds the records (and adopts staged images left without one) and
carries on. Each push goes to the store the agent is configured with now. Chunks that reached
the store in an earlier attempt are skipped (dedup), so each attempt only sends what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from spotguard import operations
from spotguard import retry as retries
from spotguard.errors import SpotguardError
from spotguard.facts import InstanceFacts
from spotguard.image import ImageSettings

from .metrics import AgentMetrics

log = logging.getLogger(__name__)


class KeptPusher:
    """One retrying push per kept image; ``on_durable(kept, result)`` once each lands."""

    def __init__(
        self,
        *,
        metrics: AgentMetrics,
        on_durable: Callable[[operations.KeptImage, operations.CheckpointResult], None],
        store_url: str,
        images: operations.KeptImages,
        image_settings: ImageSettings,
        instance: Callable[[], InstanceFacts],
        max_backoff_s: float = 60.0,
        first_backoff_s: float = 0.5,
    ) -> None:
        self.metrics = metrics
        self.on_durable = on_durable
        self.store_url = store_url
        self.images = images
        self.image_settings = image_settings
        self.instance = instance
        self.max_backoff_s = max_backoff_s
        self.first_backoff_s = first_backoff_s
        self.pending: dict[str, dict[str, Any]] = {}  # record path → status
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def jobs(self) -> set[str]:
        """Jobs with an image still waiting for the store."""
        return {str(p["job"]) for p in self.pending.values()}

    def status(self, job: str | None = None) -> list[dict[str, Any]]:
        return [dict(p) for p in self.pending.values() if job is None or p["job"] == job]

    def add_all(self, kept: Iterable[operations.KeptImage]) -> None:
        """Start pushing each of ``kept`` (the images a stopped agent left on this host)."""
        for k in kept:
            self.add(k)

    def add(self, kept: operations.KeptImage) -> bool:
        """Start pushing ``kept`` (False when it is being pushed already)."""
        key = str(kept.record)
        if key in self._tasks and not self._tasks[key].done():
            return False
        self.pending[key] = {
            **kept.to_json(),
            "attempts": 0,
            "last_error": kept.error,
            "next_attempt": None,
        }
        self.metrics.kept_images.set(len(self.pending))
        log.warning(
            "pushing a kept image until the store takes it",
            extra={"step": "upload", "job": kept.job, "dir": str(kept.dir), "error": kept.error},
        )
        self._tasks[key] = asyncio.create_task(self._push(kept), name=f"push-kept-{kept.job}")
        return True

    async def aclose(self) -> None:
        """Stop retrying (the records stay: the next agent carries on)."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()

    async def _push(self, kept: operations.KeptImage) -> None:
        key = str(kept.record)
        status = self.pending[key]

        def before_sleep(r: retries.Retry) -> None:
            exc = r.error
            status["last_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            status["next_attempt"] = time.time() + r.wait
            self.metrics.failures.labels("upload").inc()
            if not isinstance(exc, SpotguardError | OSError) and r.attempt == 1:
                log.error("kept image push failed unexpectedly; retrying", exc_info=exc)
            if retries.sparse(r.attempt):
                log.warning(
                    "kept image not pushed yet; retrying",
                    extra={
                        "step": "upload",
                        "job": kept.job,
                        "attempt": r.attempt,
                        "retry_in": round(r.wait, 2),
                        "error": status["last_error"],
                    },
                )

        async def push() -> operations.CheckpointResult:
            status["attempts"] += 1
            return await operations.push_kept(
                kept,
                self.store_url,
                images=self.images,
                image_settings=self.image_settings,
                instance=self.instance(),
            )

        # any failure is retried (an unexpected one must not end the pushes), until cancelled
        policy = retries.RetryPolicy(
            attempts=None, initial=self.first_backoff_s, maximum=self.max_backoff_s, jitter=0
        )
        result = await retries.call(push, policy, Exception, on_retry=before_sleep)
        self.pending.pop(key, None)
        self.metrics.kept_images.set(len(self.pending))
        try:
            self.on_durable(kept, result)
        except Exception as exc:  # the image is durable; a reporting bug must not hide it
            log.error("kept image durable, but reporting it failed", exc_info=exc)
