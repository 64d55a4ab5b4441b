"""A local user against wake-on-connect (issue 27, case 4): the port of a job parked as an
image must never be free while it comes back. Real job, real CRIU, a real unprivileged user.

Before the fix, the wake listener closed its sockets before CRIU re-created the job's: a user
looping on ``bind`` took the port in that gap, its service answered the job's clients, and the
restore failed (the unpark stalled until the listener's retries ran out). Now the listener's
sockets are root's and ``SO_REUSEPORT``: CRIU's restored listening socket (also root's, and
bound with ``SO_REUSEPORT`` by CRIU) joins them, so the port is held by one or the other at
every moment, and the listener hands its waiting clients over only once the job listens.

The park side had the same gap: the dump ends the job's processes (closing its listening
socket) before the listener starts, and a user looping on ``bind`` took the port there (the
park then failed: "its wake-on-connect listener did not start"). Now the park keeps the job's
own socket open through the dump (``pidfd_getfd``) and hands it to the listener, which binds
beside it before letting it go (:mod:`spotguard.park.bridge`)."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sec_helpers import SYSTEM_PYTHON, Attacker, new_user

from sgtest import free_port, wait_for
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs
from spotguard.park import bridge, record, wake
from spotguard.park.sockets import Address

JOBS = str(Path(__file__).parent.parent / "park" / "park_jobs.py")

#: the other user: binds the port (every way an ordinary user can) as fast as it can; once it
#: has it, it answers every client with "attacker" for 3 s
SQUAT = r"""
import socket, sys, time
port = int(sys.argv[1])
print("ready", flush=True)
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nattacker"
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
        except OSError:
            s.close()
            continue
        print("BOUND", host, reuseport, flush=True)
        s.settimeout(0.1)
        until = time.monotonic() + 3
        while time.monotonic() < until:
            try:
                c, _ = s.accept()
            except OSError:
                continue
            c.recv(4096)
            c.sendall(ANSWER)
            c.close()
        s.close()
    if tries % 3000 == 0:
        print("tries", tries, flush=True)
"""


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def sg(tmp_path: Path, state_dir: Path, criu_bin: str) -> Iterator[Callable[..., object]]:
    """``spotguard --config <this test's config> ARGS`` (never raises on a non-zero exit);
    afterwards every job and listener the test left is killed."""
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{state_dir}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\ncriu_timeout = 60\n'
        f'[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
    )

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "spotguard", "--config", str(cfg), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    yield run
    for rec in record.all_records(state_dir):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            os.kill(rec.waker_pid, signal.SIGKILL)
    for job in list_jobs(state_dir):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], signal.SIGKILL)


@pytest.fixture
def job_user() -> Iterator[Attacker]:
    """A second ordinary user, the job's owner (made for the test, removed after it)."""
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv")
    with new_user("sgjob") as user:
        yield user


@pytest.fixture
def port() -> int:
    return free_port()


def _lines(state_dir: Path, job: str) -> list[str]:
    p = state_dir / "jobs" / job / "stdout"
    return p.read_text().splitlines() if p.exists() else []


#: polled often: the window in which an unpark holds the park lock is short
_wait = functools.partial(wait_for, every=0.02)


def _lock_taken(state_dir: Path, job: str) -> bool:
    """Whether a park or unpark of ``job`` holds its park lock now."""
    path = record.parked_dir(state_dir) / f"{job}.lock"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _get(port: int, timeout: float = 60.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/next", timeout=timeout) as r:
        return str(r.read().decode())


class _Clients:
    """Clients started one after another while the job comes back; what each was answered."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.answers: list[str] = []
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        def one() -> None:
            try:
                self.answers.append(_get(self.port))
            except OSError as exc:
                self.answers.append(f"failed: {exc}")

        t = threading.Thread(target=one)
        t.start()
        self.threads.append(t)

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(90)
        return self.answers


@pytest.fixture
def squatter(attacker: Attacker) -> Iterator[Callable[[int], list[str]]]:
    """Start the other user's bind loop on a port; call the result again to stop it and get
    what it printed."""
    procs = []

    def start(port: int) -> list[str]:
        if procs:
            # the loop itself, not runuser: runuser forwards a SIGTERM, then sleeps 2 s
            kids = Path(f"/proc/{procs[0].pid}/task/{procs[0].pid}/children").read_text()
            for kid in kids.split():
                os.kill(int(kid), signal.SIGTERM)
            out, _err = procs[0].communicate(timeout=10)
            return out.splitlines()
        p = attacker.popen(SQUAT, str(port))
        procs.append(p)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready", p.stderr.read() if p.stderr else ""
        return []

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert SYSTEM_PYTHON  # the loop runs in the system interpreter, not ours


def _wake_log(state_dir: Path) -> str:
    """The end of the listener's log (why an unpark on connect failed, when one did)."""
    path = record.parked_dir(state_dir) / "web.wake.log"
    text = path.read_text(errors="replace") if path.exists() else "(no wake log)"
    return "the listener's log ends:\n" + text[-4000:]


def _parked_server(
    sg: Callable[..., object],
    state_dir: Path,
    port: int,
    *,
    wake: bool,
    before_park: Callable[[], object] = lambda: None,
) -> int:
    """A real HTTP job holding a counter, answered once, parked to tmpfs; the listener's pid.
    ``before_park`` runs once the job serves, just before ``spotguard park``."""
    res = sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server", str(port))
    assert res.returncode == 0, res.stderr  # type: ignore[attr-defined]
    _wait(lambda: any("listening" in ln for ln in _lines(state_dir, "web")), "the server")
    assert _get(port) == "1"
    before_park()
    args = ["park", "web", "--to", "tmpfs", "--json"] + (["--wake-on-connect"] if wake else [])
    res = sg(*args)
    assert res.returncode == 0, res.stderr  # type: ignore[attr-defined]
    rec = record.load(state_dir, "web")
    assert rec is not None and rec.place == "tmpfs"
    return rec.waker_pid or 0


def test_another_user_never_gets_the_port_from_park_to_wake(
    sg: Callable[..., object],
    state_dir: Path,
    port: int,
    squatter: Callable[[int], list[str]],
) -> None:
    # the other user loops on bind from before the park: through the dump (which ends the
    # job's processes), the listener's start, the wait and the wake
    waker = _parked_server(sg, state_dir, port, wake=True, before_park=lambda: squatter(port))
    assert waker and proctree.alive(waker)
    time.sleep(0.5)  # the loop is running: the listener holds the port, every bind fails
    clients = _Clients(port)
    started = time.monotonic()
    clients.start()  # the knock
    while record.load(state_dir, "web") is not None and time.monotonic() - started < 60:
        clients.start()  # more clients while the job comes back
        time.sleep(0.03)
    answers = clients.join()
    took = time.monotonic() - started
    time.sleep(0.5)
    attacker_saw = squatter(port)
    tries = [ln for ln in attacker_saw if ln.startswith("tries")]
    print(f"woken in {took:.2f} s, {len(answers)} clients, {tries[-1:]} binds refused")
    assert not [ln for ln in attacker_saw if ln.startswith("BOUND")], attacker_saw
    assert tries  # it did try, thousands of times
    # every client, the knock and those that came during the wake, got the job's answer:
    # the job's counter, each number once, in some order
    failed = [a for a in answers if not a.isdigit()]
    assert not failed, f"{len(failed)} clients failed: {failed[:3]}; {_wake_log(state_dir)}"
    assert sorted(int(a) for a in answers) == list(range(2, 2 + len(answers))), answers
    assert took < 20, f"the unpark took {took:.1f} s; {_wake_log(state_dir)}"
    _wait(lambda: not proctree.alive(waker), "the listener to exit", 30)
    assert _get(port) == str(2 + len(answers))  # later clients reach the job directly


def test_another_user_never_gets_the_port_during_spotguard_unpark(
    sg: Callable[..., object],
    state_dir: Path,
    port: int,
    squatter: Callable[[int], list[str]],
) -> None:
    waker = _parked_server(sg, state_dir, port, wake=True)
    squatter(port)
    time.sleep(0.5)
    clients = _Clients(port)
    done: list[object] = []
    unpark = threading.Thread(target=lambda: done.append(sg("unpark", "web", "--json")))
    started = time.monotonic()
    unpark.start()
    # clients only once spotguard unpark holds the job's park lock (a client before that
    # would wake the job through the listener: the other test)
    _wait(lambda: _lock_taken(state_dir, "web") or not unpark.is_alive(), "the unpark's lock")
    while unpark.is_alive():
        clients.start()  # clients while spotguard unpark restores the job
        time.sleep(0.1)
    unpark.join()
    res = done[0]
    assert clients.threads, f"the unpark was over before a client could connect: {res}"
    assert res.returncode == 0, res.stderr  # type: ignore[attr-defined]
    took = time.monotonic() - started
    answers = clients.join()
    time.sleep(0.5)
    attacker_saw = squatter(port)
    print(f"unparked in {took:.2f} s, {len(answers)} clients during it")
    assert not [ln for ln in attacker_saw if ln.startswith("BOUND")], attacker_saw
    assert sorted(int(a) for a in answers) == list(range(2, 2 + len(answers))), answers
    assert took < 20, f"the unpark took {took:.1f} s"
    _wait(lambda: not proctree.alive(waker), "the listener to exit", 30)


#: a job of an ordinary user: listens on the port (as http.server does) until killed
USER_JOB = r"""
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
print("listening", flush=True)
time.sleep(600)
"""


def _restored_job(port: int, into: list[socket.socket]) -> None:
    """Re-create the job's listening socket as CRIU's restore does (root's, ``SO_REUSEADDR``
    and ``SO_REUSEPORT`` set before ``bind``) and answer each client ``job:`` + its bytes."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen(16)
    into.append(s)

    def answer() -> None:
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"job:" + conn.recv(100))

    threading.Thread(target=answer, daemon=True).start()


def test_an_ordinary_users_job_keeps_its_port_from_its_end_to_the_listener(
    port: int, squatter: Callable[[int], list[str]], job_user: Attacker
) -> None:
    """No CRIU: the park's steps around it, on real sockets. The job's socket is another
    user's (the CRIU test's job is root's), so sharing it needs its owner changed; a client
    that connects after the job's processes are gone and before the listener binds waits in
    the job's own queue and is answered by the restored job."""
    ids = ["--reuid", str(job_user.uid), "--regid", str(job_user.gid), "--clear-groups"]
    job = subprocess.Popen(
        ["setpriv", *ids, "--", SYSTEM_PYTHON, "-c", USER_JOB, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    restored: list[socket.socket] = []
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "listening"
        squatter(port)
        addr = Address("127.0.0.1", port)
        held = bridge.take([job.pid], [addr])  # what park does before the dump
        assert [os.fstat(s.fileno()).st_uid for s in held] == [job_user.uid]
        job.kill()  # what the dump does after it
        job.wait()
        time.sleep(0.3)  # the other user's loop runs while nothing but the park holds the port
        gap = socket.create_connection(("127.0.0.1", port), timeout=5)
        gap.sendall(b"in the gap")
        got: list[bytes] = []

        def read() -> None:
            with gap:  # closing it ends the relay
                got.append(gap.recv(100))

        reader = threading.Thread(target=read)
        reader.start()

        async def wake_job() -> None:
            _restored_job(port, restored)

        woke = asyncio.run(wake.serve([addr], wake_job, parked=lambda: not restored, bridges=held))
        reader.join(10)
        assert woke and got == [b"job:in the gap"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as later:
            later.sendall(b"later")
            assert later.recv(100) == b"job:later"  # the restored job's socket alone now
        # stopped while the restored job still holds the port: once the test closes it,
        # the port is free for anyone (that is not a gap)
        attacker_saw = squatter(port)
    finally:
        job.kill()
        for s in restored:
            s.close()
    assert not [ln for ln in attacker_saw if ln.startswith("BOUND")], attacker_saw
    assert [ln for ln in attacker_saw if ln.startswith("tries")]
