"""Jobs whose NCCL ranks span VMs: the shapes agents and the controller exchange for them.

A multi-VM NCCL run is one spotguard job per VM (``spotguard run --nccl-group NAME …`` on
each), all in one **group**. Their communicators have ranks in several jobs, so no single
agent can release or rebuild them alone; the controller is their meeting point:

* **freeze generations** — a member that must freeze (a notice, a drain) opens generation
  ``g`` of its group (``POST /v1/groups/{group}/freeze``: a :class:`FreezeRequest`, answered
  with the :class:`GroupFreeze`); every other member's agent watches the group
  (``GET …/freeze?after=G&wait=S``, a long poll) and freezes its job too, in the same mode.
  Opening a generation forgets the rounds of the older ones. Restored members open (or join)
  a generation of mode ``restore`` for the rebuild's rounds; watchers do not freeze for it.
* **rounds** — inside a generation the agents exchange their members' NCCL reports by named
  rounds (``PUT /v1/groups/{group}/rounds/{round}``: a :class:`RoundEntry`, one per job and
  round, a second put of the same job replacing its first; ``GET …/rounds/{round}?have=N&wait=S``
  answers the :class:`Round` once it holds more than ``N`` entries, or after ``S`` seconds).
  What completes a round is the agents' to judge (every rank of every communicator
  reported); the controller only keeps and hands out the entries.

The NCCL report mirrors what spotguard's shim answers to ``state``
(:class:`spotguard.checkpoint.ncclctl.Member`); see :mod:`spotguard.checkpoint.ncclgroup`.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from spotguard.errors import ConfigError
from spotguard.wirebase import Wire

#: the job's environment variable naming its group (set by ``spotguard run --nccl-group``)
GROUP_ENV = "SPOTGUARD_NCCL_GROUP"

#: a group's or round's name: one path segment
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


def check_group_name(name: str) -> str:
    """``name`` if it is a valid group name, else :class:`ConfigError` saying what is."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ConfigError(
            f"NCCL group {name!r}: use 1 to 128 letters, digits, '.', '_' or '-', starting "
            "with a letter or digit"
        )
    return name


class CommReport(Wire):
    """One communicator of one process (the shim's record)."""

    id: int
    key: str
    rank: int
    nranks: int
    dev: int
    ops: int
    send: list[tuple[int, int]] = Field(default_factory=list)
    recv: list[tuple[int, int]] = Field(default_factory=list)
    captured: int = 0
    registered: int = 0
    windows: int = 0
    devapi: int = 0


class MemberReport(Wire):
    """One process of a job with communicators: its gate's state and its communicators."""

    pid: int
    state: str
    inflight: int = 0
    memalloc: int = 0
    comms: list[CommReport] = Field(default_factory=list, max_length=4096)


class RoundEntry(Wire):
    """What one job of the group says in one round: its members' reports, the fresh
    ``ncclUniqueId`` of each communicator it gives one for (``uids``: key → uid, hex), or
    ``abort``: why it gives up (every agent then fails its freeze)."""

    job: str
    members: list[MemberReport] = Field(default_factory=list, max_length=1024)
    uids: dict[str, str] = Field(default_factory=dict)
    abort: str | None = None


class Round(Wire):
    """A round as the controller holds it: the entries so far, one per job."""

    group: str
    generation: int
    round: str
    entries: list[RoundEntry] = Field(default_factory=list)


class FreezeRequest(Wire):
    """A member opens (or joins) a freeze of its group."""

    job: str
    reason: str = ""
    mode: Literal["exit", "resume", "restore"] = "exit"


class GroupFreeze(Wire):
    """A group's newest freeze generation (0: none yet): who opened it, why, in which mode,
    and which jobs joined it."""

    group: str
    generation: int = 0
    job: str | None = None
    reason: str = ""
    mode: Literal["exit", "resume", "restore"] = "exit"
    opened_at: float = 0.0
    joined: list[str] = Field(default_factory=list)
