"""The controller's job states: where a job is in its life, one vocabulary for the controller
(:mod:`spotguard.controller.state` keeps its jobs in them) and the wire
(:class:`spotguard.contracts.Directive`'s ``state``: what the agent reads). The wire and
database values are the strings. See docs/controller.md for the diagram.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    """Where a job is in its life. See docs/controller.md for the diagram."""

    PROTECTED = "protected"  # an agent protects it on its current instance
    INTERRUPTING = "interrupting"  # a notice arrived; waiting for a durable image
    CHECKPOINTED = "checkpointed"  # a durable image exists; waiting for the VM to let go
    LAUNCHING = "launching"  # choosing an offer / launching (round token persisted first)
    RESTORING = "restoring"  # instance launched with the assignment; waiting for the agent
    PARKED = "parked"  # parked to a store: no process, the image kept; waits for an unpark
    FAILED = "failed"  # gave up; ``reason`` says why
    FINISHED = "finished"  # the job exited by itself


#: states a job does not leave by itself
TERMINAL = frozenset({JobState.FAILED, JobState.FINISHED})

#: states in which a job is being brought back on a new instance: no settled owner yet
MOVING = frozenset({JobState.LAUNCHING, JobState.RESTORING})
