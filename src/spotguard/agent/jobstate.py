"""The agent's one vocabulary for where a job stands, and the moves its worker may make.

The worker (:class:`spotguard.agent.worker.JobWorker`), the daemon that sets up each worker,
and the ledger (:mod:`spotguard.agent.ledger`) all speak :class:`JobState`. It is a
``StrEnum``, so JSON on the wire (status, waiters' answers) and the ledger's files carry the
same plain strings as before (``"protecting"``, ``"stood_down"``, ...).

This is not the controller's :class:`spotguard.controller.state.JobState`: that one follows
a job across machines (launching, restoring, ...); this one is one agent's view of one job
on its own host. They share no members on purpose — ``protecting`` here is not the
controller's ``protected`` — so neither is built from the other.
"""

from __future__ import annotations

from enum import StrEnum

from spotguard.errors import JobStateError


class JobState(StrEnum):
    """Where one job stands for this agent."""

    PROTECTING = "protecting"  # guarded: notices and the periodic timer checkpoint it
    CHECKPOINTING = "checkpointing"  # a checkpoint runs now
    EXITING = "exiting"  # ledger only: an exit checkpoint may stop the job (the intent)
    EXITED = "exited"  # stopped by an exit checkpoint whose image is durable
    FINISHED = "finished"  # its process ended by itself
    PUSHING = "pushing"  # stopped; its image waits on this host for the store
    PARKED = "parked"  # parked as an image; guarded again once it runs
    STOOD_DOWN = "stood_down"  # owned by another instance: this agent does nothing for it


#: The worker's allowed moves. A fresh worker starts ``protecting``; the daemon moves it at
#: once to an outcome it found on disk (pushing, exited, parked, stood_down). A checkpoint
#: running when the worker stands down still finishes, so its outcome (exited, pushing)
#: may follow ``stood_down``; a kept image that lands moves ``pushing`` to ``exited``. The
#: other outcomes are final for that worker: a job that runs again gets a new worker.
_OUTCOMES = frozenset(
    {JobState.EXITED, JobState.FINISHED, JobState.PUSHING, JobState.PARKED, JobState.STOOD_DOWN}
)
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PROTECTING: _OUTCOMES | {JobState.CHECKPOINTING},
    JobState.CHECKPOINTING: _OUTCOMES | {JobState.PROTECTING},
    JobState.STOOD_DOWN: frozenset({JobState.EXITED, JobState.PUSHING}),
    JobState.PUSHING: frozenset({JobState.EXITED}),  # its kept image became durable
}

#: Where the worker acts for the job (takes requests, checkpoints).
ACTIVE = frozenset({JobState.PROTECTING, JobState.CHECKPOINTING})

#: What the ledger records (its files' ``state``): never a passing checkpoint, never a
#: state the agent learns again from the process table (finished, parked).
LEDGER_STATES = frozenset(
    {JobState.PROTECTING, JobState.EXITING, JobState.EXITED, JobState.PUSHING, JobState.STOOD_DOWN}
)


def check_move(job: str, old: JobState, new: JobState) -> None:
    """Raise :class:`~spotguard.errors.JobStateError` unless ``old`` → ``new`` is allowed
    (staying put is always allowed)."""
    if new is not old and new not in TRANSITIONS.get(old, frozenset()):
        raise JobStateError(f"job {job}: cannot move from {old.value} to {new.value}")
