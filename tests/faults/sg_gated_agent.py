"""A stand-in for ``spotguard agent`` in a local VM that holds the job in ``restoring``: it
reads the controller's assignment, reports RESTORING, waits until the file named by
``STANDIN_GATE`` exists, then reports RESTORED — shaped like the agent's events, over real
HTTP — and stays up like a VM. A report that finds the controller down (restarting) is sent
again, as the agent's spool does. Each VM appends its id to ``STANDIN_LOG``.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from spotguard.contracts import AnyEvent, Assignment, EventKind, make_event


def post(url: str, token: str, ev: AnyEvent) -> None:
    body = ev.model_dump_json().encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    deadline = time.monotonic() + 60
    while True:
        try:
            req = urllib.request.Request(url + "/v1/events", data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=10) as resp:
                print(resp.status, resp.read()[:200], flush=True)
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                raise
            print("controller unreachable, retrying:", exc, flush=True)
            time.sleep(0.2)


def main() -> int:
    a = Assignment.model_validate_json(Path(os.environ["SPOTGUARD_ASSIGNMENT"]).read_text())
    url = os.environ["SPOTGUARD_CONTROLLER_URL"]
    token = os.environ["SPOTGUARD_CONTROLLER_TOKEN"]
    vm = os.environ["SPOTGUARD_LOCAL_VM_ID"]
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(f"{a.job} {vm}\n")
    instance = {"provider": "local", "instance_id": vm}
    common = {"job": a.job, "instance": instance, "image_url": a.image_url, "attempt": a.attempt}
    post(url, token, make_event(kind=EventKind.RESTORING, **common))
    gate = Path(os.environ["STANDIN_GATE"])
    while not gate.exists():
        time.sleep(0.05)
    post(url, token, make_event(kind=EventKind.RESTORED, pid=os.getpid(), **common))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
