"""What a checkpoint does to its job: the one vocabulary of modes and notice actions.

Shared by the agent's policy, the engine, the reports on the wire and the controller
(:mod:`spotguard.contracts` re-exports both); the wire and file values are the strings.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    """What happens to a job once its image is complete — the one spelling of a checkpoint's
    mode from the agent's policy through the engine to the reports and the controller (the
    wire and file values are the strings)."""

    RESUME = "resume"  # leave running (periodic checkpoint, drain-and-stay)
    EXIT = "exit"  # stop it (the machine is going away)


class Action(StrEnum):
    """What an agent does about a notice (its policy's answer, ``[agent] policy_*`` and the
    :class:`NoticeEvent`'s ``decision``): nothing, or a checkpoint in a :class:`Mode`."""

    NONE = "none"  # acknowledge and carry on
    RESUME = Mode.RESUME.value  # checkpoint; the job keeps running
    EXIT = Mode.EXIT.value  # checkpoint; the job is stopped (the VM is going away)

    @property
    def mode(self) -> Mode | None:
        """The checkpoint this action takes; ``None`` for :attr:`NONE`."""
        return None if self is Action.NONE else Mode(self.value)
