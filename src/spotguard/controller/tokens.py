"""Who is calling the controller API: the fleet (admin) token, or a VM token scoped to one job
and one ownership epoch.

* The **admin token** (``controller_token`` / ``controller_token_file`` /
  ``SPOTGUARD_CONTROLLER_TOKEN``) is for operators and the CLI. It never leaves the controller
  host: no assignment or user-data carries it.
* A **VM token** ``sgvm1.<job>.<epoch>.<mac>`` is issued by the controller in each launched
  instance's assignment (or by ``spotguard controller --issue-token JOB`` for a job's first
  instance). ``mac`` is HMAC-SHA256 over ``job.epoch`` with the token key, so the controller
  verifies it without storing it, across restarts. It may report events and read the
  directive of its job only, and the state machine ignores its events once its epoch no
  longer owns the job (:func:`spotguard.controller.machine.stale`).

The token key is read from ``vm_token_key_file``, or derived from the admin token (then
rotating the admin token revokes every VM token — the agents of running jobs must be given
new ones). See docs/security.md.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from spotguard.errors import AuthError
from spotguard.names import VM_TOKEN_PREFIX, check_job_name, token_scope

_DERIVE = b"spotguard vm-token key v1"


@dataclass(frozen=True)
class Caller:
    """A verified caller: the admin, or a VM acting for ``job`` under ``epoch``."""

    admin: bool
    job: str | None = None
    epoch: int | None = None

    def may_act_for(self, job: str) -> bool:
        return self.admin or self.job == job


class TokenKeys:
    """Verifies bearer tokens and issues VM tokens."""

    def __init__(self, admin_token: str, key: bytes | None = None) -> None:
        if not admin_token:
            raise ValueError("an admin token is required")
        self._admin = admin_token.encode()
        self._key = key or hmac.new(self._admin, _DERIVE, hashlib.sha256).digest()

    def _mac(self, job: str, epoch: int) -> str:
        digest = hmac.new(self._key, f"{job}.{epoch}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def issue(self, job: str, epoch: int) -> str:
        """The token of ``job``'s owner at ``epoch``."""
        check_job_name(job)
        if epoch < 0:
            raise ValueError("epoch must be >= 0")
        return f"{VM_TOKEN_PREFIX}{job}.{epoch}.{self._mac(job, epoch)}"

    def verify(self, token: str) -> Caller:
        """The caller ``token`` names; :class:`AuthError` when it is neither the admin token
        nor a VM token this controller issued."""
        if hmac.compare_digest(token.encode(), self._admin):
            return Caller(admin=True)
        scope = token_scope(token)
        if scope is not None:
            job, epoch = scope
            if hmac.compare_digest(token.encode(), self.issue(job, epoch).encode()):
                return Caller(admin=False, job=job, epoch=epoch)
        raise AuthError("wrong bearer token")
