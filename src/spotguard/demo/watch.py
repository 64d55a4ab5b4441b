"""Following the run from the outside, the way an operator would: the controller's API and
the store.

:class:`Follower` polls ``GET /v1/jobs/{job}`` and announces each new history row (every agent
report and state change) once; its :meth:`~Follower.until` waits for a condition and turns any
sign of a broken chain — a failed checkpoint or restore report, a job the controller gave up
on, an agent that died, a stage that took too long — into a :class:`~spotguard.errors.DemoError`
naming the step. :func:`store_bytes` watches bytes arrive in the store while an image streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from spotguard.controller.client import ControllerClient
from spotguard.demo.report import MIB
from spotguard.demo.ui import Ui
from spotguard.errors import DemoError, JobNotFound, SpotguardError, without_type
from spotguard.store import open_store

View = dict[str, Any]
Check = Callable[[str], None]  # raises DemoError(step, ...) for a broken link

POLL_S = 0.15

#: the link of the chain a job was in when the controller gave up, by the state it left
_STEP_OF_STATE = {
    "interrupting": "freeze",
    "checkpointed": "relaunch",
    "launching": "relaunch",
    "restoring": "restore",
}


#: the links of the chain in the order the run passes them
_CHAIN = ("protect", "notice", "freeze", "relaunch", "restore", "finish")


def _event(row: dict[str, Any]) -> str | None:
    ev = (row.get("detail") or {}).get("event")
    return str(ev) if ev else None


class Follower:
    """Reads the job's view from the controller and tells the UI what happened."""

    def __init__(self, client: ControllerClient, job: str, ui: Ui, vms: dict[str, str]) -> None:
        self.client = client
        self.job = job
        self.ui = ui
        self.vms = vms  # instance id → "VM 1" / "VM 2"
        self.view: View = {}
        self.checks: list[Check] = []
        self._seen = 0

    def _where(self, row: dict[str, Any]) -> str:
        iid = (row.get("detail") or {}).get("instance")
        return self.vms.get(str(iid), str(iid or "an instance"))

    def _announce(self, row: dict[str, Any]) -> None:
        ev, to, frm = _event(row), row.get("to"), row.get("from")
        where = self._where(row)
        text: str | None = None
        if ev == "started" and to == "protected":
            text = f"the agent on {where} protects the job (controller: protected)"
        elif ev == "notice":
            text = f"the agent on {where} saw the notice and reported it"
        elif ev == "frozen":
            text = f"frozen: the job's state is in {where}'s memory"
        elif ev == "durable":
            text = f"durable: {row.get('reason') or 'the image is in the store'}"
        elif ev == "exited":
            text = f"the job is stopped on {where}; its image is complete"
        elif ev == "ready_to_relaunch":
            text = f"drain done on {where}: ready to relaunch"
        elif ev == "restoring":
            text = f"the agent on {where} is downloading, verifying and restoring the image"
        elif ev == "restored":
            text = f"restored: the job runs again on {where}"
        elif ev == "job_finished":
            text = f"the job finished on {where}"
        elif to == "launching" and frm != "launching":
            text = "the controller relaunches the job (local provider)"
        elif to == "restoring" and frm != "restoring":
            text = "VM 2 launched: its agent starts with the assignment"
        if text:
            self.ui.event(text)

    def _failed(self, row: dict[str, Any], step: str) -> None:
        ev = _event(row)
        first = _readable((row.get("detail") or {}).get("error") or row.get("reason"))
        if ev == "checkpoint_failed":
            raise DemoError("freeze", f"the checkpoint failed on {self._where(row)}: {first}")
        if ev == "restore_failed":
            raise DemoError("restore", f"the restore failed on {self._where(row)}: {first}")
        if row.get("to") == "failed" and row.get("from") != "failed":
            where = _STEP_OF_STATE.get(str(row.get("from")), step)
            if where in _CHAIN and step in _CHAIN and _CHAIN.index(step) > _CHAIN.index(where):
                # the run already got past that link (e.g. VM 2 was launched and restoring):
                # the controller gives up at the start of its next round, whose state names
                # an earlier link
                where = step
            raise DemoError(where, f"the controller gave up on the job: {row.get('reason')}")

    async def refresh(self, step: str) -> View:
        """The job's current view; new history rows announced (and checked) once each."""
        try:
            view = (await self.client.job(self.job)).to_json()
        except JobNotFound:
            return {}
        except SpotguardError as exc:
            raise DemoError(step, f"the controller did not answer: {exc}") from exc
        history: list[dict[str, Any]] = view.get("history") or []
        for row in history[self._seen :]:
            self._announce(row)
            self._failed(row, step)
        self._seen = max(self._seen, len(history))
        self.view = view
        return view

    async def until(
        self, step: str, waiting: str, done: Callable[[View], bool], within: float
    ) -> View:
        """Poll until ``done(view)``; a failure sign, or ``within`` seconds passing, raises
        :class:`DemoError`."""
        end = time.monotonic() + within
        announced = False
        while True:
            view = await self.refresh(step)  # announces what already happened first
            if done(view):
                return view
            if not announced:  # a wait that is already over is not announced after the fact
                self.ui.waiting(waiting)
                announced = True
            if view.get("state") == "finished":
                raise DemoError(step, f"the job finished before this happened: {waiting}")
            for check in self.checks:
                check(step)
            if time.monotonic() > end:
                state = view.get("state", "unknown to the controller")
                reason = view.get("reason") or "no reason recorded"
                raise DemoError(
                    step, f"{waiting}: nothing after {within:.0f} s (job {state}: {reason})"
                )
            await asyncio.sleep(POLL_S)


def has_event(view: View, event: str, *, after: float = 0.0) -> bool:
    """True once the controller applied an ``event`` report (at or after ``after``)."""
    return any(
        _event(h) == event and float(h.get("at", 0)) >= after for h in view.get("history") or []
    )


async def store_bytes(store_url: str, prefix: str, ui: Ui, stop: asyncio.Event) -> None:
    """Show the bytes under ``prefix`` in the store (and their rate) until ``stop`` is set."""
    store = open_store(store_url)
    t0 = time.monotonic()
    try:
        while not stop.is_set():
            try:
                total = sum(o.size for o in await store.list(prefix))
            except SpotguardError:
                total = 0
            if total >= MIB / 10:  # a figure that reads "0.0 MiB" says nothing yet
                rate = total / MIB / max(time.monotonic() - t0, 1e-3)
                ui.progress(f"{total / MIB:.1f} MiB in the store ({rate:.1f} MiB/s)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
    finally:
        await store.aclose()


def _readable(error: Any) -> str:
    """An agent's reported error (a WireError's fields, or text) as one line a person reads:
    its message, without the error type in front."""
    if isinstance(error, dict):
        error = error.get("message") or error.get("code")
    text = str(error or "no reason").strip()
    return without_type(text.splitlines()[0] if text else "no reason")
