"""Keep a parked job's ports bound from its dump until its wake listener holds them.

A park with ``--wake-on-connect`` dumps the job (CRIU then ends its processes, which closes
their listening sockets) and only then starts the listener (:mod:`.waker`, :mod:`.wake`).
Between the two the port was free, and any local user could bind it: the listener then
failed to start and the user's service answered the job's clients.

So, just before the dump, :func:`take` duplicates each of the job's listening sockets with
``pidfd_getfd(2)`` (root, Linux 5.6+). A socket lives while any fd refers to it, so the
duplicate keeps the job's very socket bound and listening after the job's processes are gone;
a client that connects in between waits in its accept queue instead of being refused.
The duplicates go to the listener process (inherited fds, named in :data:`ENV`), which
:func:`adopt`\\ s them: it makes each one shareable by its own sockets, binds those beside it
and then accepts what the duplicate still holds and closes it (:class:`.wake.Listeners`).

Making the duplicate shareable (the kernel's ``SO_REUSEPORT`` rules, ``inet_bind_conflict``:
every socket on the port must have ``SO_REUSEPORT`` and the same owner):

* ``SO_REUSEPORT`` is set on it (the kernel reads the flag at each bind, so setting it on a
  listening socket counts), and its owner becomes root with ``fchown`` (for a socket the
  kernel also moves the owner it compares, ``sk_uid``). Both happen after the dump, when the
  job no longer has the socket, so the image records the job's own options;
* connections that completed into its queue before that are sockets on the same port, made
  as the job's user without ``SO_REUSEPORT``: they are accepted and given the same two
  settings. Those that complete later inherit them from the listening socket.

Every bind by another user keeps failing throughout: the duplicate, then the listener's own
sockets, are never shareable with another owner.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Sequence

from . import sockets
from .sockets import Address

log = logging.getLogger(__name__)

#: the inherited duplicates' fd numbers, comma-separated, in the listener's environment
ENV = "SPOTGUARD_WAKE_BRIDGE_FDS"

#: duplicates taken by a park in this process, waiting for the job's listener (job → sockets)
_kept: dict[str, list[socket.socket]] = {}


def take(tree: Iterable[int], addrs: Sequence[Address]) -> list[socket.socket]:
    """Duplicates of the tree's listening sockets on ``addrs``, one per socket. Best effort:
    a socket that cannot be duplicated is left out (its port is then free between the dump
    and the listener's start, as it was without this), and logged."""
    want = set(addrs)
    out: list[socket.socket] = []
    seen: set[int] = set()
    for ref in sockets.tcp_sockets(tree):
        fact = ref.fact
        if fact.state != "LISTEN" or fact.local not in want or fact.inode in seen:
            continue
        try:
            out.append(socket.socket(fileno=sockets.pidfd_getfd(ref.pid, ref.fd)))
        except OSError as exc:
            log.warning(
                "cannot hold a listening socket of the job through its park",
                extra={"pid": ref.pid, "error": str(exc)},
            )
            continue
        seen.add(fact.inode)
    return out


def keep(job: str, socks: list[socket.socket]) -> None:
    """Hold ``socks`` for ``job``'s listener (:func:`pop`), replacing any left before."""
    release(job)
    if socks:
        _kept[job] = socks


def pop(job: str) -> list[socket.socket]:
    """The duplicates kept for ``job`` (the caller closes them); none when nothing was kept."""
    return _kept.pop(job, [])


def release(job: str) -> None:
    """Close what is kept for ``job`` (its park failed, or it has no listener to take them)."""
    close(_kept.pop(job, []))


def close(socks: Iterable[socket.socket]) -> None:
    for s in socks:
        s.close()


def env_for(socks: Sequence[socket.socket]) -> dict[str, str]:
    """The environment entry naming ``socks`` to the listener (passed with ``pass_fds``)."""
    return {ENV: ",".join(str(s.fileno()) for s in socks)} if socks else {}


def inherited() -> list[socket.socket]:
    """The duplicates this process was started with (and forgets the entry); fds that are
    not listening TCP sockets are closed and left out."""
    text = os.environ.pop(ENV, "")
    out: list[socket.socket] = []
    for part in filter(None, text.split(",")):
        try:
            s = socket.socket(fileno=int(part))
        except (ValueError, OSError) as exc:
            log.warning("bad inherited socket", extra={"error": f"{part!r}: {exc}"})
            continue
        if s.type != socket.SOCK_STREAM or not s.getsockopt(
            socket.SOL_SOCKET, socket.SO_ACCEPTCONN
        ):
            s.close()
            continue
        out.append(s)
    return out


def _share(s: socket.socket) -> None:
    """``SO_REUSEPORT`` on, owner this process's user: root's reuseport sockets may join."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    os.fchown(s.fileno(), os.geteuid(), os.getegid())


def adopt(s: socket.socket) -> list[socket.socket]:
    """Make the duplicate ``s`` shareable (see the module doc); the client connections that
    were waiting in its queue, accepted, shareable too, non-blocking."""
    _share(s)
    s.setblocking(False)
    clients = []
    while True:
        try:
            conn, _peer = s.accept()
        except OSError:  # BlockingIOError: the queue is empty
            break
        _share(conn)
        conn.setblocking(False)
        clients.append(conn)
    return clients


def address_of(s: socket.socket) -> Address:
    """The address ``s`` is bound to, in the park record's form."""
    host, port = s.getsockname()[:2]
    return Address(str(host), int(port))
