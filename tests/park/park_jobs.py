"""Small real jobs for the park tests (run as scripts by ``spotguard run``).

``pair STEPS [GATE]``: a parent and a forked worker talking over a socketpair and over loopback
TCP; each step the parent sends a number to the worker both ways and prints what came back, so
the output is a pure function of the step — any lost or repeated step shows. With GATE (a
path), the pair waits before its last quarter of steps until that file exists, so a test can
park and unpark it as often as it likes before it ends.

``server PORT``: an HTTP server holding a counter in memory; ``GET /next`` answers the next
number, ``GET /ping`` answers ``pong`` without touching the counter.

``busy``: burns CPU. ``sleeper``: does nothing at all. ``big MIB``: holds MIB MiB of
non-zero memory (so a dump of it takes seconds) and prints once it does.
"""

from __future__ import annotations

import http.server
import os
import socket
import sys
import time


def pair(steps: int, gate: str | None = None) -> None:
    a, b = socket.socketpair()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    port = lsock.getsockname()[1]
    if os.fork() == 0:
        a.close()
        tcp = socket.create_connection(("127.0.0.1", port))
        while True:
            data = b.recv(64)
            if not data:
                os._exit(0)
            n = int(data)
            b.sendall(str(n * n).encode())
            tcp.sendall(str(n * 3).encode().ljust(16))
    b.close()
    conn, _ = lsock.accept()
    for i in range(steps):
        if gate is not None and i == steps * 3 // 4:
            while not os.path.exists(gate):
                time.sleep(0.05)
        a.sendall(str(i).encode())
        sq = int(a.recv(64))
        tr = int(conn.recv(16))
        print(f"step {i} {sq} {tr}", flush=True)
        time.sleep(0.05)
    print("done", flush=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client may hold one connection
    counter = 0

    def do_GET(self) -> None:
        if self.path == "/next":
            _Handler.counter += 1
            body = str(_Handler.counter).encode()
        else:
            body = b"pong"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        print("request", self.path, flush=True)


def server(port: int) -> None:
    srv = http.server.HTTPServer(("127.0.0.1", port), _Handler)
    print(f"listening {port}", flush=True)
    srv.serve_forever()


def sqlite(db: str) -> None:
    """Keeps a SQLite database open and writes a row every 0.1 s (IPython's history does the
    same): after a restore it must still be writable."""
    import sqlite3

    con = sqlite3.connect(db)
    con.execute("create table if not exists t (i integer)")
    con.commit()
    i = 0
    while True:
        try:
            con.execute("insert into t values (?)", (i,))
            con.commit()
            print(f"row {i}", flush=True)
        except sqlite3.Error as exc:
            print(f"ERROR {exc}", flush=True)
        i += 1
        time.sleep(0.1)


def busy() -> None:
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def big(mib: int) -> None:
    block = os.urandom(1 << 20)
    held = [bytearray(block) for _ in range(mib)]  # every page written: CRIU dumps them all
    print(f"holding {len(held)} MiB", flush=True)
    sleeper()


def sleeper() -> None:
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "pair":
        pair(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    elif what == "server":
        server(int(sys.argv[2]))
    elif what == "sqlite":
        sqlite(sys.argv[2])
    elif what == "busy":
        busy()
    elif what == "big":
        big(int(sys.argv[2]))
    else:
        sleeper()
