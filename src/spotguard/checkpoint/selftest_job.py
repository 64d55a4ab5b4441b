"""The job ``spotguard doctor`` checkpoints and restores (stdlib only; run as a script).

Why this shape: it holds, in two processes of one tree, every kind of socket real jobs hold
and that CRIU must carry across a dump — a listening TCP socket, an established loopback TCP
connection between the processes, and a socketpair — and its output is a pure function of
its arguments, so a run that was dumped, killed and restored prints exactly what an
uninterrupted run prints.

``python -I selftest_job.py STEPS STEP_SECONDS``: the parent listens on 127.0.0.1 (port
chosen by the kernel), forks a worker that connects to it, then each step sends a number
over the established connection and over the socketpair, opens one fresh connection to the
listener (so the listening socket is proven to accept after a restore) and prints the
answers: ``step I tcp A pair B new C``. At the end it prints ``done CHECKSUM`` and exits 0.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import socket
import struct
import sys
import time

_FMT = "!q"
_SIZE = struct.calcsize(_FMT)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError("peer closed")
        buf += part
    return buf


def _ask(sock: socket.socket, value: int) -> int:
    sock.sendall(struct.pack(_FMT, value))
    return int(struct.unpack(_FMT, _recv_exact(sock, _SIZE))[0])


def _answer(sock: socket.socket, salt: int) -> bool:
    """Serve one request on ``sock``; False once the peer has closed it."""
    try:
        data = _recv_exact(sock, _SIZE)
    except (EOFError, ConnectionError):
        return False
    (value,) = struct.unpack(_FMT, data)
    sock.sendall(struct.pack(_FMT, value * 3 + salt))
    return True


def _worker(listener: socket.socket, pair: socket.socket, port: int) -> None:
    """Answer on the established connection, the socketpair and every fresh connection."""
    conn = socket.create_connection(("127.0.0.1", port))
    _recv_exact(pair, 1)  # the parent has accepted ``conn``: now the worker may accept too
    sel = selectors.DefaultSelector()
    sel.register(conn, selectors.EVENT_READ, 1)
    sel.register(pair, selectors.EVENT_READ, 2)
    accepted = listener  # the worker answers the parent's fresh connections
    sel.register(accepted, selectors.EVENT_READ, 0)
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is accepted:
                fresh, _addr = sock.accept()
                sel.register(fresh, selectors.EVENT_READ, 3)
                continue
            if not _answer(sock, int(key.data)):
                sel.unregister(sock)
                sock.close()
                if sock is pair:
                    return


def expected(steps: int) -> str:
    """What a run of ``steps`` steps prints, dumped and restored or not."""
    digest = hashlib.sha256()
    out = []
    for i in range(1, steps + 1):
        line = f"step {i} tcp {i * 3 + 1} pair {i * 3 + 2} new {i * 3 + 3}"
        digest.update(line.encode())
        out.append(line + "\n")
    out.append(f"done {digest.hexdigest()[:16]}\n")
    return "".join(out)


def main() -> int:
    steps, step_seconds = int(sys.argv[1]), float(sys.argv[2])
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    mine, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:
        mine.close()
        try:
            _worker(listener, theirs, port)
        finally:
            os._exit(0)
    theirs.close()
    established, _addr = listener.accept()  # the worker's; fresh ones are the worker's to accept
    mine.sendall(b"g")
    digest = hashlib.sha256()
    for i in range(1, steps + 1):
        tcp = _ask(established, i)
        pair = _ask(mine, i)
        with socket.create_connection(("127.0.0.1", port)) as fresh:
            new = _ask(fresh, i)
        line = f"step {i} tcp {tcp} pair {pair} new {new}"
        digest.update(line.encode())
        print(line, flush=True)
        time.sleep(step_seconds)
    established.close()
    mine.close()
    os.waitpid(child, 0)
    print(f"done {digest.hexdigest()[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
