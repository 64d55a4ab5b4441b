"""A job that holds one thing CRIU cannot dump, then prints one line per step (so a test
sees it keep running) and ``done`` at the end.

``python hold.py KIND STEPS STEP_SECONDS [PORT]`` with KIND one of:
``uring`` (an io_uring from the raw io_uring_setup syscall, mapped), ``vsock`` (an AF_VSOCK
socket), ``perf`` (a software perf event), ``tcp`` (a connection to 127.0.0.1:PORT, a server
outside the job), ``unbound`` (a TCP and a UDPv6 socket, created and never bound or
connected: in no /proc/net table, and CRIU dumps them all the same).
"""

from __future__ import annotations

import ctypes
import mmap
import socket
import struct
import sys
import time

SYS_PERF_EVENT_OPEN = 298  # x86-64
SYS_IO_URING_SETUP = 425


def _syscall_fd(nr: int, *args: object) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(nr, *args))
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"syscall {nr} failed")
    return fd


def hold(kind: str, port: int) -> object:
    """Create the resource; the returned object keeps it open."""
    if kind == "uring":
        params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
        fd = _syscall_fd(SYS_IO_URING_SETUP, 4, params)
        return mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ, offset=0)
    if kind == "vsock":
        return socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    if kind == "perf":
        # struct perf_event_attr: type PERF_TYPE_SOFTWARE (1), size, config CPU_CLOCK (0)
        attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 0) + bytes(112))
        return _syscall_fd(SYS_PERF_EVENT_OPEN, attr, 0, -1, -1, 0)
    if kind == "tcp":
        return socket.create_connection(("127.0.0.1", port))
    if kind == "unbound":
        return socket.socket(), socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    raise SystemExit(f"unknown kind {kind!r}")


def main() -> int:
    kind, steps, step_seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    held = hold(kind, int(sys.argv[4]) if len(sys.argv) > 4 else 0)
    for i in range(1, steps + 1):
        print(f"step {i} {kind}", flush=True)
        time.sleep(step_seconds)
    print("done", flush=True)
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
