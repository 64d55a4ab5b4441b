"""Wake-on-connect of a GPU server parked as an image, while another local user loops on
``bind`` for its port (issue 27, case 4; device machine: scripts/gpu-tests).

The restore of a GPU job takes seconds (its GPU memory comes back), the widest window the
old code left open: its wake listener closed the port before CRIU re-created the job's
socket. Now the listener holds the port until the restored socket has joined it
(``SO_REUSEPORT``, root's; :mod:`spotguard.park.wake`): the user never gets it, and every
client, the knock and those that come during the restore, is answered by the job. The user
loops from before the park: the park's dump ends the job's processes, and the park holds the
job's own socket until the listener has the port (:mod:`spotguard.park.bridge`). The wake
time is printed (docs/benchmarks.md)."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_gpu_park import JOBS, Sg, _get, _port, _ready, gpu_ready, sg

from sgtest import wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.criu]
__all__ = ["gpu_ready", "sg"]

MB = int(os.environ.get("SPOTGUARD_WAKE_TEST_MB", "4096"))
#: binds the port every way an ordinary user can, as fast as it can; says when it got it
SQUAT = r"""
import socket, sys
port = int(sys.argv[1])
print("ready", flush=True)
tries = 0
while True:
    for host, reuseport in (("127.0.0.1", False), ("0.0.0.0", False), ("127.0.0.1", True)):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        tries += 1
        try:
            s.bind((host, port))
            s.listen(16)
            print("BOUND", host, reuseport, flush=True)
        except OSError:
            pass
        s.close()
    if tries % 3000 == 0:
        print("tries", tries, flush=True)
"""


@pytest.fixture
def other_user() -> Iterator[str]:
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("needs root, useradd and runuser")
    name = f"sgatk{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    try:
        pwd.getpwnam(name)
        yield name
    finally:
        subprocess.run(["userdel", "--force", name], check=False, capture_output=True)


def test_gpu_server_parked_to_tmpfs_wakes_while_another_user_loops_on_bind(
    gpu_ready: None, sg: Sg, other_user: str
) -> None:
    port = _port()
    sg("run", "--name", "srv", "--", sys.executable, str(JOBS / "server.py"), str(port),
       str(MB))  # fmt: skip
    wait_for(lambda: _ready(port), "the server to answer", limit=300)
    before = _get(port, "/infer?x=3")
    record = Path(sg.root) / "state" / "parked" / "srv.json"
    # the other user loops on bind from before the park: through the GPU dump (which ends the
    # job's processes; the park keeps the job's socket open until the listener binds beside
    # it, spotguard.park.bridge), the wait and the wake
    squat = subprocess.Popen(
        ["runuser", "-u", other_user, "--", "/usr/bin/python3", "-c", SQUAT, str(port)],
        stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    try:
        assert squat.stdout is not None and squat.stdout.readline().strip() == "ready"
        sg("park", "srv", "--to", "tmpfs", "--wake-on-connect")
        time.sleep(0.5)
        answers: list[str] = []

        def client() -> None:
            try:
                answers.append(_get(port, "/infer?x=3", timeout=300))
            except OSError as exc:
                answers.append(f"failed: {exc}")

        threads = []
        t0 = time.monotonic()
        while not threads or (record.exists() and time.monotonic() - t0 < 300):
            threads.append(threading.Thread(target=client))
            threads[-1].start()  # the knock, then one client every 0.1 s during the restore
            time.sleep(0.1)
        for t in threads:
            t.join(300)
        wake_s = time.monotonic() - t0
    finally:
        squat.terminate()
        out, _ = squat.communicate(timeout=30)
    lines = out.splitlines()
    tries = [ln for ln in lines if ln.startswith("tries")]
    print(f"\nGPU server ({MB} MiB) parked to tmpfs: woken in {wake_s:.2f} s, "
          f"{len(answers)} clients, {tries[-1:]} binds by another user refused")  # fmt: skip
    assert not [ln for ln in lines if ln.startswith("BOUND")], lines[:20]
    assert answers and all(a == before for a in answers), answers
