"""What the agent does about each kind of notice.

A :class:`Policy` maps a :class:`~spotguard.notices.base.Notice` to a :class:`Decision`: which
:class:`Action` to take and when to start it. Defaults follow what each notice means:

=============== ========== ===========================================================
kind            default    why
=============== ========== ===========================================================
``preempt``     ``exit``   the VM dies at the deadline: freeze, stop, stream, report
``rebalance``   ``resume`` risk went up: take a fresh image now so a later terminate is
                           small (dedup), and keep training
``maintenance`` ``exit``   the host goes down at ``NotBefore``: checkpoint shortly before
                           it (``maintenance_lead``) and stop, or ``resume`` to stay
``drain``       ``exit``   an operator vacates the node: checkpoint, stop, "ready to relaunch"
=============== ========== ===========================================================

Live maintenance (GCP ``MIGRATE_ON_HOST_MAINTENANCE``, Azure ``Freeze``) keeps memory intact,
so it is ignored unless ``maintenance_live`` says otherwise. A cancelled notice never leads to
an action.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from spotguard.modes import Action
from spotguard.notices.base import Notice, NoticeKind

__all__ = ["DEFAULT_ACTIONS", "LIVE_MAINTENANCE", "Action", "Decision", "Policy"]

DEFAULT_ACTIONS: Mapping[NoticeKind, Action] = {
    NoticeKind.PREEMPT: Action.EXIT,
    NoticeKind.REBALANCE: Action.RESUME,
    NoticeKind.MAINTENANCE: Action.EXIT,
    NoticeKind.DRAIN: Action.EXIT,
}

#: maintenance actions (cloud wording, lower case) during which memory survives
LIVE_MAINTENANCE = frozenset({"migrate_on_host_maintenance", "migrate", "freeze"})


@dataclass(frozen=True)
class Decision:
    """The policy's answer for one notice: ``action`` starting at ``start_at`` (UTC)."""

    action: Action
    start_at: datetime
    reason: str


@dataclass(frozen=True)
class Policy:
    """Notice kind → action, plus the timing rules for scheduled maintenance."""

    actions: Mapping[NoticeKind, Action]
    maintenance_live: Action = Action.NONE
    maintenance_lead_s: float = 300.0

    @classmethod
    def default(cls) -> Policy:
        return cls(dict(DEFAULT_ACTIONS))

    def decide(self, notice: Notice, now: datetime | None = None) -> Decision:
        """The action for ``notice`` and when to begin it (never later than needed)."""
        now = now or datetime.now(UTC)
        if notice.cancelled:
            return Decision(Action.NONE, now, "notice cancelled")
        action = self.actions.get(notice.kind, Action.NONE)
        reason = f"{notice.kind.value} → {action.value}"
        if notice.kind is NoticeKind.MAINTENANCE:
            if (notice.action or "").lower() in LIVE_MAINTENANCE:
                action = self.maintenance_live
                reason = f"live maintenance ({notice.action}) → {action.value}"
            # Scheduled events can be far ahead (and may be cancelled): start just in time.
            start = notice.deadline - timedelta(seconds=self.maintenance_lead_s)
            return Decision(action, max(now, start), reason)
        return Decision(action, now, reason)
