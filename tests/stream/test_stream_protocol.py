"""The image-streamer wire format, against a real unix socket pair."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from spotguard.stream import protocol


@pytest.mark.parametrize("name", ["pages-1.img", "x" * 300, "inventory.img", "ünïcode.img"])
def test_request_roundtrip(name: str) -> None:
    framed = protocol.encode_request(name)
    length = int.from_bytes(framed[:4], "little")
    assert length == len(framed) - 4
    assert protocol.decode_request(framed[4:]) == name


@pytest.mark.parametrize("exists", [True, False])
def test_reply_roundtrip(exists: bool) -> None:
    framed = protocol.encode_reply(exists)
    assert framed[:4] == (2).to_bytes(4, "little")
    assert protocol.decode_reply(framed[4:]) is exists


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_request(b"\x12\x03abc")
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_request(b"\x0a\x10ab")  # length beyond the body


async def test_connection_reads_requests_and_pipes_in_order() -> None:
    """Requests and the pipes that follow them are paired even when sent back to back."""
    a, b = socket.socketpair()
    conn = protocol.Connection(a)
    pipes = [os.pipe() for _ in range(3)]
    try:
        for i, (r, _w) in enumerate(pipes):
            b.sendall(protocol.encode_request(f"f{i}.img"))
            socket.send_fds(b, [b"\0"], [r])
        b.shutdown(socket.SHUT_WR)
        got = []
        while (name := await asyncio.wait_for(conn.read_request(), 5)) is not None:
            fd = await conn.recv_pipe()
            got.append((name, os.fstat(fd).st_ino))
            os.close(fd)
        assert got == [(f"f{i}.img", os.fstat(r).st_ino) for i, (r, _w) in enumerate(pipes)]
    finally:
        conn.close()
        b.close()
        for r, w in pipes:
            os.close(r)
            os.close(w)


async def test_oversized_request_is_refused() -> None:
    a, b = socket.socketpair()
    conn = protocol.Connection(a)
    try:
        b.sendall((1 << 30).to_bytes(4, "little"))
        with pytest.raises(protocol.ProtocolError):
            await asyncio.wait_for(conn.read_request(), 5)
    finally:
        conn.close()
        b.close()
