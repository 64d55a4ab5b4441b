"""Wake on connect: the first client to connect to a parked job unparks it.

A job suspended in place still owns its sockets: :func:`serve_in_place` watches their accept
queues and wakes the job when a client waits; the job then accepts it itself.

A job parked as an image has no sockets any more. A listener process (``spotguard park-wake
JOB``, started detached by ``park --wake-on-connect``) binds every TCP address the job had.
When a client connects, it accepts every connection waiting, closes its listeners (the
restored job binds the same ports), unparks the job and then relays each held connection to
the job, byte for byte, until either side closes. The client sees a slower first answer,
not a refused connection. Later clients reach the job directly.

The one gap: a connection that arrives after the listeners close and before CRIU has
re-created the job's listening socket (early in the restore, before memory is loaded) is
refused. CRIU cannot hand an inet socket to a restored process (``--inherit-fd`` covers
pipes, files and unix sockets), so the listener cannot simply pass its socket on.

If the unpark fails, the held connections are closed, the state stays parked, and the
listener binds again and waits for the next client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from spotguard.errors import SpotguardError

from . import sockets
from .sockets import Address

log = logging.getLogger(__name__)

_CONNECT_TRIES = 300  # x 0.05 s: how long to wait for the restored job to accept
_CHUNK = 256 * 1024


@dataclass
class Held:
    """A client connection accepted on ``addr`` while the job was parked."""

    conn: socket.socket
    addr: Address


def _listen(addr: Address, v6only: bool) -> socket.socket:
    family = sockets.family_of(addr)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        # as the job's socket most likely was (Linux's default: dual stack), unless the job
        # also listened on the same port over IPv4
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0)
    s.bind((addr.host, addr.port))
    s.listen(128)
    s.setblocking(False)
    return s


def _accept_waiting(listener: socket.socket, addr: Address, held: list[Held]) -> None:
    while True:
        try:
            conn, _peer = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        conn.setblocking(False)
        held.append(Held(conn, addr))


async def wait_for_client(
    addrs: Sequence[Address], stop: asyncio.Event, ready: Callable[[], None] | None = None
) -> list[Held]:
    """Listen on ``addrs`` until a client connects (→ the connections held) or ``stop`` is
    set (→ no connections). The listeners are closed either way."""
    v4_ports = {a.port for a in addrs if ":" not in a.host}
    listeners = [(_listen(a, a.port in v4_ports), a) for a in addrs]
    loop = asyncio.get_running_loop()
    held: list[Held] = []
    woke = asyncio.Event()

    def on_readable(listener: socket.socket, addr: Address) -> None:
        _accept_waiting(listener, addr, held)
        if held:
            woke.set()

    try:
        for listener, addr in listeners:
            loop.add_reader(listener.fileno(), on_readable, listener, addr)
        if ready is not None:
            ready()
        waits = {asyncio.ensure_future(woke.wait()), asyncio.ensure_future(stop.wait())}
        _done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for p in pending:
            p.cancel()
        if woke.is_set():
            for listener, addr in listeners:  # take whoever is still in the backlog
                _accept_waiting(listener, addr, held)
    finally:
        for listener, _addr in listeners:
            loop.remove_reader(listener.fileno())
            listener.close()
    if stop.is_set() and not woke.is_set():
        return []
    return held


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


async def serve(
    addrs: Sequence[Address],
    wake: Callable[[], Awaitable[object]],
    *,
    ready: Callable[[], None] | None = None,
    retry_s: float = 5.0,
) -> bool:
    """Hold ``addrs`` until a client connects, then ``wake()`` the job and relay the clients.

    Returns True once the job was woken and every held client relayed; False when stopped
    (SIGTERM/SIGINT) before any client came. A signal during ``wake`` does not interrupt it
    (an unpark is never cut in half); ``wake`` should refuse at once when another unpark of
    the job holds its lock, and then the signal that came with that unpark ends the listener.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        while True:
            held = await wait_for_client(addrs, stop, ready)
            ready = None
            if not held:
                return False
            log.info("a client connected to a parked job; unparking", extra={"clients": len(held)})
            try:
                await wake()
            except SpotguardError as exc:
                log.error("unpark on connect failed; still parked", extra={"error": str(exc)})
                for h in held:
                    h.conn.close()
                if stop.is_set():
                    return False
                await asyncio.sleep(retry_s)
                continue
            await asyncio.gather(*(relay(h) for h in held))
            return True
    finally:
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
