"""Start the wake-on-connect listener of a parked job as its own detached process.

The listener must outlive the command (or agent) that parked the job, so it is a process of
its own (``spotguard park-wake JOB``, a new session, output in
``<state_dir>/parked/<job>.wake.log``). It records its pid in the park record once it holds
every port; :func:`spawn` returns only then, so no client is refused after park returns.

The job's own listening sockets, kept by the park since before the dump (:mod:`.bridge`), are
passed on to it (inherited fds), so that the port stays bound until it holds it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from spotguard import safefs
from spotguard.errors import ParkError

from . import bridge, record

READY_S = 15.0


def spawn(state_dir: Path, job: str, config: str | None = None) -> int:
    """Start the listener for ``job`` and wait until it holds the job's ports; its pid.
    What this process kept of the job's sockets (:func:`.bridge.pop`) goes to it, and is
    closed here once it has started."""
    held = bridge.pop(job)
    try:
        return _spawn(state_dir, job, config, held)
    finally:
        bridge.close(held)


def _spawn(state_dir: Path, job: str, config: str | None, held: list[socket.socket]) -> int:
    argv = [sys.executable, "-m", "spotguard"]
    if config:
        argv += ["--config", config]
    argv += ["park-wake", job, "--state-dir", str(state_dir)]
    logf = record.parked_dir(state_dir) / f"{job}.wake.log"
    with safefs.opened_private_dir(logf.parent) as dfd:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        out_fd = os.open(logf.name, flags, 0o600, dir_fd=dfd)
    with os.fdopen(out_fd, "ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            pass_fds=[s.fileno() for s in held],
            env={**os.environ, **bridge.env_for(held)},
        )
    bridge.close(held)  # the listener has them now
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        rec = record.load(state_dir, job)
        if rec is not None and rec.waker_pid == proc.pid:
            return proc.pid
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    lines = logf.read_text(errors="replace").strip().splitlines() if logf.exists() else []
    why = f": {lines[-1]}" if lines else ""
    raise ParkError(
        f"job {job!r} is parked, but its wake-on-connect listener did not start{why}; "
        f"unpark it with: spotguard unpark {job}"
    )
