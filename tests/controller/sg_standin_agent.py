"""A stand-in for ``spotguard agent`` in a local VM: reads the assignment the controller
delivered and reports RESTORING then RESTORED (or RESTORE_FAILED with STANDIN_FAIL=<Error
class>; with STANDIN_FAIL_IMAGE=<url> too, only for that image), shaped exactly like the
agent's events, over real HTTP. Then stays up like a VM would.
With STANDIN_LOSE_FIRST=<file>, the first VM (the one that finds no such file: it creates it)
reports RESTORING and then dies before restoring, like a spot instance taken back at once.
With STANDIN_NO_FACTS=1 its reports name no instance, like an agent with ``cloud=none`` or an
unreadable metadata service.

It exists so the controller's side of restore-on-boot is tested independently of the agent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from spotguard import errors
from spotguard.contracts import AnyEvent, Assignment, EventKind, WireError, make_event


def post(url: str, token: str, ev: AnyEvent) -> None:
    req = urllib.request.Request(
        url + "/v1/events",
        data=ev.model_dump_json().encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        print(resp.status, json.loads(resp.read()), flush=True)


def _error(name: str) -> WireError:
    """The wire form of the spotguard error class ``name``, as the agent would send it."""
    cls = getattr(errors, name)
    try:
        exc = cls("GPU model differs")
    except TypeError:  # MismatchError names both sides
        exc = cls("GPU model", "h100", "a10g")
    return WireError.of(exc)


def main() -> int:
    a = Assignment.model_validate_json(Path(os.environ["SPOTGUARD_ASSIGNMENT"]).read_text())
    url = os.environ["SPOTGUARD_CONTROLLER_URL"]
    token = os.environ["SPOTGUARD_CONTROLLER_TOKEN"]
    instance = {"provider": "local", "instance_id": os.environ["SPOTGUARD_LOCAL_VM_ID"]}
    if os.environ.get("STANDIN_NO_FACTS"):
        instance = {}
    detail = {"attempt": a.attempt}
    post(
        url,
        token,
        make_event(
            job=a.job,
            kind=EventKind.RESTORING,
            instance=instance,
            image_url=a.image_url,
            **detail,
        ),
    )
    marker = os.environ.get("STANDIN_LOSE_FIRST")
    if marker:
        try:
            with open(marker, "x") as f:
                f.write(instance["instance_id"])
        except FileExistsError:
            pass
        else:
            return 0
    fail = os.environ.get("STANDIN_FAIL")
    only = os.environ.get("STANDIN_FAIL_IMAGE")  # fail for this image only
    if fail and only not in (None, a.image_url):
        fail = None
    if fail:
        post(
            url,
            token,
            make_event(
                job=a.job,
                kind=EventKind.RESTORE_FAILED,
                instance=instance,
                image_url=a.image_url,
                error=_error(fail),
                **detail,
            ),
        )
    else:
        post(
            url,
            token,
            make_event(
                job=a.job,
                kind=EventKind.RESTORED,
                instance=instance,
                image_url=a.image_url,
                pid=os.getpid(),
                **detail,
            ),
        )
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
