"""What agents send, checked at the controller's edge (issue 31): one bad report must never
poison a job's answers or ``jobs list``.

* :func:`parse_lenient` — an agent event whose only problem is fields this controller does
  not know (a newer agent) is applied without them; the fields are named for the history and
  logged once per kind and field (:data:`LOGGED_FIELDS`). A bad value is still a 400.
* :func:`instance_facts` / :func:`instance_info` — a job's ``instance`` is always stored as
  :class:`~spotguard.contracts.InstanceInfo` facts, whatever it came from (an agent's facts,
  a launched ``InstanceRef``, a record an older controller wrote), so every answer about the
  job can be built from it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from spotguard.contracts import AnyEvent, InstanceInfo, parse_event

LOGGED_FIELDS: set[tuple[str, str]] = set()  # (kind, field) already logged as unexpected


def _drop(doc: Any, path: tuple[str | int, ...]) -> None:
    """Remove the key at ``path`` from the nested dicts/lists of ``doc`` (if it is there)."""
    for step in path[:-1]:
        if isinstance(doc, dict) and isinstance(step, str):
            doc = doc.get(step)
        elif isinstance(doc, list) and isinstance(step, int) and step < len(doc):
            doc = doc[step]
        else:
            return
    if isinstance(doc, dict):
        doc.pop(path[-1], None)


def parse_lenient(body: bytes) -> tuple[AnyEvent, list[str]]:
    """An agent event from ``body``, validated at the edge: fields this controller does not
    know (a newer agent's) are dropped and named in the second value (dotted paths); any
    other problem raises :class:`ValidationError` as :func:`parse_event` does."""
    try:
        return parse_event(body), []
    except ValidationError as first:
        errors = first.errors()
        extra = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
        if not extra or len(extra) != len(errors):
            raise
        doc = json.loads(body)
        ignored: list[str] = []
        for loc in extra:
            path = tuple(loc[1:])  # loc[0] is the union's tag (the event's kind)
            if path:
                _drop(doc, path)
                ignored.append(".".join(str(x) for x in path))
        return parse_event(json.dumps(doc)), sorted(ignored)


_FACT_KEYS = frozenset(InstanceInfo.model_fields)


def instance_facts(d: dict[str, Any] | None) -> dict[str, Any]:
    """``d`` — an agent's :class:`InstanceInfo`, a launched ``InstanceRef.to_json()`` or a
    record written by an older controller — as instance facts: only the keys
    :class:`InstanceInfo` knows (``market`` becomes ``spot``). A job's ``instance`` is always
    stored in this shape, so every answer about the job can be built from it."""
    src = dict(d or {})
    out = {k: v for k, v in src.items() if k in _FACT_KEYS and k != "extra"}
    if "spot" not in out and "market" in src:
        out["spot"] = src["market"] == "spot"
    extra = src.get("extra")
    if isinstance(extra, dict) and "market" not in src:
        out["extra"] = extra  # an agent's own extra facts (a provider ref's are its own)
    return out


def instance_info(d: dict[str, Any] | None) -> InstanceInfo:
    """:func:`instance_facts` as an :class:`InstanceInfo` (never raises for a stored record:
    a value of the wrong type is dropped)."""
    facts = instance_facts(d)
    try:
        return InstanceInfo.model_validate(facts)
    except ValidationError:
        keep = {k: v for k, v in facts.items() if isinstance(v, str | bool) or v is None}
        keep.pop("extra", None)
        try:
            return InstanceInfo.model_validate(keep)
        except ValidationError:
            return InstanceInfo(instance_id=str(facts.get("instance_id") or "") or None)
