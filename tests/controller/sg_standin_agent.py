"""A stand-in for ``spotguard agent`` in a local VM: reads the assignment the controller
delivered and reports RESTORING then RESTORED (or RESTORE_FAILED with STANDIN_FAIL=<Error>),
shaped exactly like the agent's AgentEvents, over real HTTP. Then stays up like a VM would.
With STANDIN_LOSE_FIRST=<file>, the first VM (the one that finds no such file: it creates it)
reports RESTORING and then dies before restoring, like a spot instance taken back at once.

It exists so the controller's side of restore-on-boot is tested independently of the agent.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from spotguard.contracts import AgentEvent, Assignment, EventKind


def post(url: str, token: str, ev: AgentEvent) -> None:
    req = urllib.request.Request(
        url + "/v1/events",
        data=ev.model_dump_json().encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        print(resp.status, json.loads(resp.read()), flush=True)


def main() -> int:
    a = Assignment.model_validate_json(Path(os.environ["SPOTGUARD_ASSIGNMENT"]).read_text())
    url = os.environ["SPOTGUARD_CONTROLLER_URL"]
    token = os.environ["SPOTGUARD_CONTROLLER_TOKEN"]
    instance = {"provider": "local", "instance_id": os.environ["SPOTGUARD_LOCAL_VM_ID"]}
    detail = {"attempt": a.attempt}
    post(
        url,
        token,
        AgentEvent(
            job=a.job,
            kind=EventKind.RESTORING,
            instance=instance,
            image_url=a.image_url,
            detail=detail,
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
    if fail:
        post(
            url,
            token,
            AgentEvent(
                job=a.job,
                kind=EventKind.RESTORE_FAILED,
                instance=instance,
                image_url=a.image_url,
                error=f"{fail}: GPU model differs",
                detail={**detail, "reason": fail},
            ),
        )
    else:
        post(
            url,
            token,
            AgentEvent(
                job=a.job,
                kind=EventKind.RESTORED,
                instance=instance,
                image_url=a.image_url,
                detail={**detail, "pid": os.getpid()},
            ),
        )
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
