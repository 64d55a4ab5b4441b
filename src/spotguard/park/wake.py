"""Wake on connect: the first client to connect to a parked job unparks it.

A job suspended in place still owns its sockets: :func:`serve_in_place` watches their accept
queues and wakes the job when a client waits; the job then accepts it itself.

A job parked as an image has no sockets any more. A listener process (``spotguard park-wake
JOB``, started detached by ``park --wake-on-connect``) binds every TCP address the job had.
When a client connects, it unparks the job **while still holding the ports**, and only once
the restored job listens does it let go of them and relay each connection it accepted to the
job, byte for byte, until either side closes. Later clients reach the job directly.

Holding the port through the restore (no gap another local user could bind in): CRIU 4.2
cannot hand an inet socket to a restored process (``--inherit-fd`` is honoured only for
files, pipes, unix sockets, memfds and ttys: ``criu/sk-inet.c``'s file ops have no ``name``
and ``open_inet_sk`` never looks the inherited fds up), so the listener cannot pass its
socket on. Instead it relies on the kernel's ``SO_REUSEPORT`` rules:

* its sockets are root's and bound with ``SO_REUSEPORT``; CRIU, which runs as root, creates
  the job's socket before it restores the job's credentials and sets ``SO_REUSEADDR`` and
  ``SO_REUSEPORT`` on every inet socket before binding it (``open_inet_sk``; the job's own
  values come back once all are bound). So CRIU's bind succeeds beside ours, and its
  ``listen`` joins our reuseport group;
* the kernel lets a socket share a port only with sockets of the same owner that all set
  ``SO_REUSEPORT`` (``inet_bind_conflict``): any bind by another user fails, with or without
  ``SO_REUSEADDR``/``SO_REUSEPORT``, on the address or on ``0.0.0.0``, at every moment;
* a classic BPF program on our socket (``SO_ATTACH_REUSEPORT_CBPF``, "pick member 1")
  steers every new connection to the job's socket as soon as it is in the group (member 0
  is ours; with us alone the index is out of range and the kernel picks us). It is detached
  before we close, so the job's group is left as CRIU made it.

Then the listener accepts what is still in its own queue (handshakes begun before the job's
socket existed, for up to :data:`SETTLE_MAX_S`), closes its sockets and relays. A client never
sees a refused connection, and no other user can take the port from park-wake's start to the
job's restored socket.

Before park-wake starts, the park holds the port: it keeps the job's own listening socket open
through the dump and passes it on (:mod:`.bridge`); :class:`Listeners` binds beside it, then
takes the clients waiting in it and closes it. So the port is never free from the park to the
restored job.

If the unpark fails, the held connections are closed, the state stays parked, and the
listener keeps the ports and waits for the next client. When someone else unparks the job
(``spotguard unpark``, the agent), it waits on the job's park lock, then finds the job running
and hands its clients to it the same way; that unpark stops the listener (SIGTERM) once the job
runs, and the listener hands over whatever it accepted before exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from spotguard.errors import ParkError, SpotguardError

from . import bridge, sockets
from .sockets import Address

log = logging.getLogger(__name__)

_CONNECT_TRIES = 300  # x 0.05 s: how long to wait for the restored job to accept
_CHUNK = 256 * 1024
#: accept what is left in our queue until it stays empty this long, at most SETTLE_MAX_S
SETTLE_QUIET_S = 0.05
SETTLE_MAX_S = 1.0
_SO_ATTACH_REUSEPORT_CBPF = 51  # <asm-generic/socket.h>
_SO_DETACH_REUSEPORT_BPF = 68
_BPF_RET_K = 0x06  # BPF_RET | BPF_K
#: the steering program: "the group's member 1" (the job's socket, once CRIU has made it)
_STEER = struct.pack("HBBI", _BPF_RET_K, 0, 0, 1)


@dataclass
class Held:
    """A client connection accepted on ``addr`` while the job was parked."""

    conn: socket.socket
    addr: Address


def _steer_to_job(s: socket.socket) -> None:
    """Attach the steering program to ``s``'s reuseport group (see the module doc). Best
    effort: without it the kernel spreads new connections over the listener and the job's
    socket while the job comes back, and the listener relays those it gets."""
    code = ctypes.create_string_buffer(_STEER, len(_STEER))
    prog = struct.pack("HP", 1, ctypes.addressof(code))  # struct sock_fprog (native layout)
    try:
        s.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_REUSEPORT_CBPF, prog)
    except OSError as exc:
        log.warning("cannot steer connections to the restored job", extra={"error": str(exc)})


def _v6only(s: socket.socket) -> bool:
    return bool(s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY))


def _listen(addr: Address, v6only: bool) -> socket.socket:
    """A root-owned ``SO_REUSEPORT`` listener on ``addr`` that the restored job's socket can
    join (and no other user's socket can)."""
    family = sockets.family_of(addr)
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            # as the job's socket most likely was (Linux's default: dual stack), unless the
            # job also listened on the same port over IPv4
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0)
        s.bind((addr.host, addr.port))
        s.listen(128)
        _steer_to_job(s)
        s.setblocking(False)
    except OSError:
        s.close()
        raise
    return s


class Listeners:
    """The sockets holding a parked job's addresses, from park-wake's start until the restored
    job listens on them.

    ``bridges``: the job's own listening sockets, kept open since before its dump
    (:mod:`.bridge`). Each is made shareable, our socket on its address binds beside it (and
    gets new connections: the steering program picks member 1, ours), and the clients that
    were waiting in it are in :attr:`early`; :meth:`retire_bridges` then empties and closes
    them. The port is never free in between."""

    def __init__(self, addrs: Sequence[Address], bridges: Sequence[socket.socket] = ()) -> None:
        v4_ports = {a.port for a in addrs if ":" not in a.host}
        self.socks: list[tuple[socket.socket, Address]] = []
        self.bridges: list[tuple[socket.socket, Address]] = []
        #: clients that connected between the job's dump and this listener's start
        self.early: list[Held] = []
        by_addr = {bridge.address_of(b): b for b in bridges}
        a: Address | None = None
        try:
            for a in addrs:
                self._hold(a, by_addr.pop(a, None), a.port in v4_ports)
        except OSError as exc:
            self.close()
            _drop(self.early)
            raise ParkError(
                f"cannot hold the parked job's address {a}: {exc.strerror or exc}"
            ) from exc
        finally:
            bridge.close(by_addr.values())  # none of the job's addresses: not ours to hold

    def _hold(self, addr: Address, b: socket.socket | None, v6only: bool) -> None:
        """Listen on ``addr``, beside the job's socket ``b`` when there is one."""
        if b is not None:
            try:
                self.early += [Held(c, addr) for c in bridge.adopt(b)]
            except OSError as exc:  # not shareable: let it go (the port is free a moment)
                log.warning("cannot share the job's socket", extra={"error": str(exc)})
                b.close()
                b = None
        if b is None:
            self.socks.append((_listen(addr, v6only), addr))
            return
        try:
            self.socks.append((_listen(addr, b.family == socket.AF_INET6 and _v6only(b)), addr))
        except OSError as exc:
            # something else on the port cannot share it (say a connection the job left
            # without SO_REUSEPORT): hold the job's socket itself; the restored job's joins it
            log.warning("holding the job's own socket", extra={"error": str(exc)})
            self.socks.append((b, addr))
            return
        self.bridges.append((b, addr))

    def accept_waiting(self, held: list[Held]) -> int:
        """Accept every connection waiting on any of the sockets into ``held``; how many."""
        n = 0
        for listener, addr in self.socks:
            while True:
                try:
                    conn, _peer = listener.accept()
                except OSError:  # BlockingIOError: the queue is empty
                    break
                conn.setblocking(False)
                held.append(Held(conn, addr))
                n += 1
        return n

    async def settle(self, held: list[Held]) -> None:
        """Take what is left in our queues (the job's socket gets every new connection now):
        until they stay empty for :data:`SETTLE_QUIET_S`, at most :data:`SETTLE_MAX_S`."""
        end = time.monotonic() + SETTLE_MAX_S
        quiet_since = time.monotonic()
        while time.monotonic() < end:
            if self.accept_waiting(held):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= SETTLE_QUIET_S:
                return
            await asyncio.sleep(0.01)

    async def retire_bridges(self, held: list[Held]) -> None:
        """Our sockets listen beside the bridges and get every new connection: take what is
        left in the bridges' queues (as :meth:`settle` does), then close them."""
        if not self.bridges:
            return
        end = time.monotonic() + SETTLE_MAX_S
        quiet_since = time.monotonic()
        while time.monotonic() < end:
            n = 0
            for b, addr in self.bridges:
                n += len(accepted := bridge.adopt(b))
                held += [Held(c, addr) for c in accepted]
            if n:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= SETTLE_QUIET_S:
                break
            await asyncio.sleep(0.01)
        bridge.close(b for b, _addr in self.bridges)
        self.bridges = []

    def close(self) -> None:
        """Detach the steering program (the group stays the job's alone), then close."""
        for listener, _addr in self.socks:
            with contextlib.suppress(OSError):
                listener.setsockopt(socket.SOL_SOCKET, _SO_DETACH_REUSEPORT_BPF, 0)
            listener.close()
        self.socks = []
        bridge.close(b for b, _addr in self.bridges)
        self.bridges = []


async def wait_for_client(listeners: Listeners, held: list[Held], stop: asyncio.Event) -> None:
    """Accept into ``held`` until a client connects or ``stop`` is set; the sockets stay
    open."""
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()

    def on_readable() -> None:
        if listeners.accept_waiting(held):
            woke.set()

    if listeners.accept_waiting(held) or held:
        return
    try:
        for listener, _addr in listeners.socks:
            loop.add_reader(listener.fileno(), on_readable)
        waits = {asyncio.ensure_future(woke.wait()), asyncio.ensure_future(stop.wait())}
        _done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for p in pending:
            p.cancel()
    finally:
        for listener, _addr in listeners.socks:
            loop.remove_reader(listener.fileno())


def _target(addr: Address) -> tuple[str, int]:
    """Where to reach the restored job for a connection that came in on ``addr``."""
    if addr.host == "0.0.0.0":
        return "127.0.0.1", addr.port
    if addr.host == "::":
        return "::1", addr.port
    return addr.host, addr.port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        return


async def relay(h: Held) -> None:
    """Relay one held client connection to the restored job until both sides are done."""
    host, port = _target(h.addr)
    for _ in range(_CONNECT_TRIES):
        try:
            job_r, job_w = await asyncio.open_connection(host, port)
            break
        except OSError:
            await asyncio.sleep(0.05)
    else:
        log.warning("the unparked job does not accept on %s; closing the client", h.addr)
        h.conn.close()
        return
    cli_r, cli_w = await asyncio.open_connection(sock=h.conn)
    await asyncio.gather(_pipe(cli_r, job_w), _pipe(job_r, cli_w))
    for w in (cli_w, job_w):
        w.close()
        with contextlib.suppress(ConnectionError, OSError):
            await w.wait_closed()


async def _hand_over(listeners: Listeners, held: list[Held]) -> None:
    """The job listens now: take what is left in our queues, let go of the ports, relay."""
    await listeners.settle(held)
    listeners.close()
    await asyncio.gather(*(relay(h) for h in held))
    held.clear()


def _drop(held: list[Held]) -> None:
    for h in held:
        h.conn.close()
    held.clear()


async def serve(
    addrs: Sequence[Address],
    wake: Callable[[], Awaitable[object]],
    *,
    parked: Callable[[], bool] = lambda: True,
    ready: Callable[[], None] | None = None,
    retry_s: float = 5.0,
    bridges: Sequence[socket.socket] | None = None,
) -> bool:
    """Hold ``addrs`` until a client connects, then ``wake()`` the job and relay the clients.

    ``parked()`` says whether the job is still parked (its record exists): when it is not,
    after a failed ``wake`` or a stop, someone else unparked it, and the clients held are
    handed to the job. Returns True once the job runs and every held client was relayed;
    False when stopped (SIGTERM/SIGINT) while the job is still parked. A signal during
    ``wake`` does not interrupt it (an unpark is never cut in half). ``wake`` should wait for
    another unpark of the job that holds its lock (and then find it no longer parked).
    ``bridges``: the job's sockets kept through its dump (:class:`Listeners`); by default
    those this process inherited from the park (:func:`.bridge.inherited`).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listeners = Listeners(addrs, bridge.inherited() if bridges is None else bridges)
    held: list[Held] = listeners.early
    try:
        if ready is not None:
            ready()
        await listeners.retire_bridges(held)
        while True:
            await wait_for_client(listeners, held, stop)
            if stop.is_set():
                if parked():
                    return False
                log.info("the job was unparked by another command; handing its clients over")
                await _hand_over(listeners, held)
                return True
            log.info("a client connected to a parked job; unparking", extra={"clients": len(held)})
            try:
                await wake()
            except SpotguardError as exc:
                if not parked():
                    log.info("the job was unparked meanwhile; handing its clients over")
                    await _hand_over(listeners, held)
                    return True
                log.error("unpark on connect failed; still parked", extra={"error": str(exc)})
                _drop(held)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), retry_s)
                if stop.is_set() and parked():
                    return False
                continue
            await _hand_over(listeners, held)
            return True
    finally:
        _drop(held)
        listeners.close()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def serve_in_place(
    tree: Callable[[], Sequence[int]],
    wake: Callable[[], Awaitable[object]],
    *,
    ready: Callable[[], None] | None = None,
    poll_s: float = 0.02,
    retry_s: float = 5.0,
) -> bool:
    """For a job suspended in place: wait until a client knocks, then ``wake()`` it.

    The job still owns its sockets while it is stopped; the kernel completes handshakes into
    their accept queues and buffers what clients send. A connection waiting to be accepted
    (or unread input on one of its connections) is the knock. Nothing is relayed: once the
    job runs it accepts and answers the waiting clients itself, so no client is refused.
    Returns True once woken, False when stopped by SIGTERM/SIGINT first.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if ready is not None:
            ready()
        while not stop.is_set():
            knocks = await asyncio.to_thread(sockets.waiting_clients, tree())
            if knocks:
                log.info("a client knocked on a parked job; unparking", extra={"clients": knocks})
                try:
                    await wake()
                    return True
                except SpotguardError as exc:
                    log.error("unpark on connect failed; still parked", extra={"error": str(exc)})
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), retry_s)
                    continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), poll_s)
        return False
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
