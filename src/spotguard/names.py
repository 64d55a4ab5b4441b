"""Names in the store and on tokens: job names, image ids and the object keys of the store
layout (see :mod:`spotguard.contracts` for the layout itself).

Kept apart from :mod:`spotguard.contracts` on purpose: the checkpoint path (``spotguard
checkpoint``, the engine, the image writer) needs only these few functions, and importing the
wire's pydantic models with them cost every checkpoint ~0.1 s before the freeze could start.
:mod:`spotguard.contracts` re-exports them.
"""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime

_JOB_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


def check_job_name(name: str) -> str:
    """Job names are used in object keys, tags and file names: lowercase, digits, ``._-``."""
    if not _JOB_RE.match(name):
        raise ValueError(
            f"invalid job name {name!r}: use 1-63 of a-z 0-9 . _ - (starting with a letter/digit)"
        )
    return name


#: Prefix of VM tokens: ``sgvm1.<job>.<epoch>.<mac>`` (see :mod:`spotguard.controller.tokens`).
VM_TOKEN_PREFIX = "sgvm1."


def token_scope(token: str) -> tuple[str, int] | None:
    """The (job, epoch) a VM token is scoped to, read without verifying it (the controller
    verifies); None for any other token."""
    if not token.startswith(VM_TOKEN_PREFIX):
        return None
    parts = token[len(VM_TOKEN_PREFIX) :].rsplit(".", 2)
    if len(parts) != 3 or not _JOB_RE.match(parts[0]) or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def new_image_id(now: datetime | None = None) -> str:
    """Sortable image id: UTC time plus a short random suffix."""
    t = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{t}-{uuid.uuid4().hex[:6]}"


def chunk_key(job: str, digest: str) -> str:
    return f"{job}/chunks/{digest[:2]}/{digest}"


def image_prefix(job: str, image_id: str) -> str:
    return f"{job}/images/{image_id}"


def manifest_key(job: str, image_id: str) -> str:
    return f"{image_prefix(job, image_id)}/manifest.json"
