"""What an agent's report tells the controller beyond its kind: the launch spec its GPUs,
host and image size imply (:func:`spec_from`), and whether a notice was applied already
under another event id (:func:`seen_notice`) — helpers of :mod:`.machine`, pure like it."""

from __future__ import annotations

import math
import time
from typing import Any

from spotguard.contracts import DurableEvent, NoticeEvent, RestoredEvent, StartedEvent
from spotguard.controller.ownership import iid_of
from spotguard.controller.state import JobRecord, SeenNotice
from spotguard.facts import GpuInventory, InstanceFacts
from spotguard.providers.base import LaunchSpec

#: How many (instance, notice) keys a job remembers for dedup of fleet and agent reports.
NOTICES_REMEMBERED = 32


def spec_from(rec: JobRecord, ev: StartedEvent | DurableEvent | RestoredEvent) -> dict[str, Any]:
    """The launch spec from what the agent reports about the job's GPUs, host and image
    size: restoring needs at least the image's bytes of host memory."""
    old = LaunchSpec.from_json(rec.spec)
    gpu = getattr(ev, "gpu", None)
    if gpu is None:
        return rec.spec
    host = ev.host.model_dump() if isinstance(ev, DurableEvent) and ev.host else None
    need = old.min_memory_mib
    if isinstance(ev, DurableEvent) and ev.image_bytes:
        need = max(need or 0, math.ceil(ev.image_bytes / 2**20))
    spec = LaunchSpec.from_facts(
        GpuInventory.from_json(gpu.model_dump()),
        InstanceFacts.from_json(ev.instance.model_dump()),
        host,
        need,
    )
    return spec.to_json()


def seen_notice(rec: JobRecord, iid: str | None, ev: NoticeEvent) -> SeenNotice | None:
    """Whether this notice (per instance, id and cancellation) was applied already; if not,
    remember it. The fleet source's ids equal the on-VM AWS source's for the same
    interruption (:mod:`spotguard.notices.fleet`), so whichever report comes second — under
    its own event id — is recognised here. Notice ids carry no instance id, hence the key."""
    nid = ev.notice.id
    if not nid:
        return None
    key = f"{iid or iid_of(rec.instance) or '-'}|{nid}|{int(ev.notice.cancelled)}"
    seen = rec.data.notices_seen
    if key in seen:
        return seen[key]
    seen[key] = SeenNotice(origin=origin(ev), at=time.time())
    for old in sorted(seen, key=lambda k: seen[k].at)[: max(0, len(seen) - NOTICES_REMEMBERED)]:
        del seen[old]
    rec.data.notices_seen = seen
    return None


def origin(ev: NoticeEvent) -> str:
    return "the fleet queue" if ev.source == "fleet" or ev.notice.cloud == "fleet" else "the agent"
