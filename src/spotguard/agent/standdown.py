"""Standing down: this agent no longer owns a job it protects, so it stops acting for it.

The controller gives each job an owner (an instance and an ownership *epoch*, see
:mod:`spotguard.controller.ownership`); a relaunch hands the job to a new epoch on another
instance. The old VM's agent may still protect a copy of the job — after a resumed checkpoint
whose deadline passed, after a restart — and its checkpoints and reports would then compete
with the new owner's. So every controller answer (to a report, and to the directive poll) is
read for two signs that the job is owned elsewhere:

* ``stand_down``: the controller judged the asker a non-owner (its epoch — from a scoped VM
  token, or the ``?epoch=`` of the poll — is not the owner's; or its report named another
  instance);
* ``owner.instance_id`` names another instance than this one while the job is not moving
  (``launching``/``restoring`` have no settled owner yet) — the sign an agent holding the fleet
  token and no epoch gets from the directive poll.

The agent then stands down for that job (:meth:`~spotguard.agent.worker.JobWorker.stand_down`):
no more checkpoints, no more reports, its ledger says ``stood_down`` so a restarted agent does
not take the job up again. The process itself is left alone: it is the operator's (and no
longer this agent's) to stop. A job whose newest image was written by another instance is the
same sign, read from the store at start (:func:`spotguard.agent.ledger.runs_elsewhere`).
"""

from __future__ import annotations

from spotguard.contracts import Directive, EventAnswer
from spotguard.lifecycle import MOVING

#: controller states in which a job has no settled owner yet (launching, restoring)
MOVING_STATES = MOVING


def owned_elsewhere(answer: Directive, instance_id: str | None) -> str | None:
    """Why the controller's ``answer`` (to a report or a directive poll) says this agent (on
    ``instance_id``) no longer owns the job it names; None when it does."""
    owner = answer.owner
    if answer.stand_down:
        refused = answer.error if isinstance(answer, EventAnswer) else None
        why = answer.reason or refused or "the controller says stand down"
        return f"{why} (owner: {owner.instance_id or 'being chosen'}, epoch {owner.epoch})"
    other = owner.instance_id
    if other and instance_id and other != instance_id and answer.state not in MOVING_STATES:
        return f"the controller's record points to {other} (epoch {owner.epoch}), not {instance_id}"
    return None
