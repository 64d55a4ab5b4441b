"""``spotguard park`` / ``unpark`` through the command line, with real jobs and real CRIU:
state kept exactly (a forked pair talking over a socketpair and loopback TCP, an HTTP server
holding a counter), back to back, refusals as one clear line, the job never lost."""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, ClassVar

import pytest
from park_helpers import JOBS, Sg, free_port, ok_json

from sgtest import wait_for as _wait
from spotguard.checkpoint import proctree, suspend
from spotguard.checkpoint.jobs import resolve_job
from spotguard.park import record

pytestmark = pytest.mark.criu

STEPS = 150
EXPECTED = [f"step {i} {i * i} {i * 3}" for i in range(STEPS)] + ["done"]


def _lines(state_dir: Path, job: str) -> list[str]:
    p = state_dir / "jobs" / job / "stdout"
    return p.read_text().splitlines() if p.exists() else []


def _get(port: int, path: str = "/next", timeout: float = 60.0) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return str(r.read().decode())


def _one_line_error(res: object) -> str:
    assert res.returncode != 0  # type: ignore[attr-defined]
    err: str = res.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("spotguard: error:"), err
    return line


def test_forked_pair_parked_in_memory_and_unparked_output_exact(sg: Sg, state_dir: Path) -> None:
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS)))
    _wait(lambda: len(_lines(state_dir, "pair")) >= 8, "the pair to make progress")
    job = resolve_job("pair", state_dir=state_dir)
    parked = ok_json(sg("park", "pair", "--to", "memory", "--reason", "lunch", "--json"))
    assert parked["job"] == "pair" and parked["place"] == "memory" and parked["parked"] is True
    assert parked["where"] == f"in place (pid {job.pid})" and parked["bytes"] > 0
    assert parked["gpu_memory_freed"] == 0 and parked["seconds"] > 0
    assert parked["reason"] == "lunch"
    assert all(suspend.stopped(p) for p in proctree.tree(job.pid))  # no CPU while parked
    frozen_at = len(_lines(state_dir, "pair"))
    time.sleep(0.5)
    assert len(_lines(state_dir, "pair")) == frozen_at  # nothing runs while parked
    back = ok_json(sg("unpark", "pair", "--json"))
    assert back["job"] == "pair" and back["place"] == "memory" and back["pid"] == job.pid
    assert record.load(state_dir, "pair") is None
    _wait(lambda: "done" in _lines(state_dir, "pair"), "the pair to finish")
    assert _lines(state_dir, "pair") == EXPECTED


def test_back_to_back_park_unpark_every_place(sg: Sg, state_dir: Path, tmp_path: Path) -> None:
    gate = tmp_path / "go"
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS),
               str(gate)))  # fmt: skip
    _wait(lambda: len(_lines(state_dir, "pair")) >= 3, "the pair to make progress")
    for place in ("disk", "tmpfs", "memory", "disk"):
        parked = ok_json(sg("park", "pair", "--to", place, "--json"))
        assert parked["place"] == place
        if place == "disk":
            assert Path(parked["where"]).is_relative_to(state_dir)
        if place == "tmpfs":
            assert Path(parked["where"]).is_dir()
        back = ok_json(sg("unpark", "pair", "--json"))
        if place != "memory":
            assert not Path(parked["where"]).exists()  # the image goes once the job runs
        assert back["place"] == place
    gate.touch()
    _wait(lambda: "done" in _lines(state_dir, "pair"), "the pair to finish")
    assert _lines(state_dir, "pair") == EXPECTED


@pytest.mark.parametrize("place", ["memory", "tmpfs"])
def test_http_server_parked_answers_the_same_after_unpark(
    sg: Sg, state_dir: Path, place: str
) -> None:
    port = free_port()
    ok_json(sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server", str(port)))
    _wait(lambda: any("listening" in ln for ln in _lines(state_dir, "web")), "the server")
    assert [_get(port) for _ in range(3)] == ["1", "2", "3"]
    parked = ok_json(sg("park", "web", "--to", place, "--json"))
    assert parked["listen"] == [f"127.0.0.1:{port}"] and parked["wake_on_connect"] is False
    if place == "tmpfs":  # the process is gone: nobody listens
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    else:  # suspended: the kernel still queues clients, nobody answers them
        with pytest.raises(OSError):
            _get(port, timeout=1)
    ok_json(sg("unpark", "web", "--json"))
    assert _get(port) == ("5" if place == "memory" else "4")  # the queued request ran first


@pytest.mark.parametrize("place", ["memory", "tmpfs"])
def test_wake_on_connect_first_request_is_answered(sg: Sg, state_dir: Path, place: str) -> None:
    port = free_port()
    ok_json(sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server", str(port)))
    _wait(lambda: any("listening" in ln for ln in _lines(state_dir, "web")), "the server")
    assert _get(port) == "1"
    parked = ok_json(sg("park", "web", "--to", place, "--wake-on-connect", "--json"))
    assert parked["wake_on_connect"] is True and parked["waker_pid"]
    assert proctree.alive(parked["waker_pid"])
    # the first client after the park is answered by the unparked job, not refused
    assert _get(port, timeout=120) == "2"
    _wait(lambda: record.load(state_dir, "web") is None, "the park record to go")
    _wait(lambda: not proctree.alive(parked["waker_pid"]), "the listener to exit")
    assert _get(port) == "3"  # later clients reach the job directly


def test_port_taken_while_parked_is_a_clear_error_and_state_is_kept(
    sg: Sg, state_dir: Path
) -> None:
    port = free_port()
    ok_json(sg("run", "--name", "web", "--json", "--", sys.executable, JOBS, "server", str(port)))
    _wait(lambda: any("listening" in ln for ln in _lines(state_dir, "web")), "the server")
    assert _get(port) == "1"
    ok_json(sg("park", "web", "--to", "tmpfs", "--json"))
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", port))
    squatter.listen(1)
    try:
        line = _one_line_error(sg("unpark", "web"))
        assert f"127.0.0.1:{port}" in line and "taken" in line and "held by pid" in line
        assert record.load(state_dir, "web") is not None  # still parked, nothing lost
    finally:
        squatter.close()
    ok_json(sg("unpark", "web", "--json"))
    assert _get(port) == "2"


def test_refusals_are_one_line_and_lose_nothing(sg: Sg, state_dir: Path, tmp_path: Path) -> None:
    assert "no job" in _one_line_error(sg("park", "nosuchjob"))
    gate = tmp_path / "go"
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS),
               str(gate)))  # fmt: skip
    _wait(lambda: len(_lines(state_dir, "pair")) >= 2, "the pair to make progress")
    line = _one_line_error(sg("park", "pair", "--to", "tape"))
    assert "--to 'tape'" in line
    assert proctree.alive(resolve_job("pair", state_dir=state_dir).pid)
    assert "is not parked" in _one_line_error(sg("unpark", "pair"))
    ok_json(sg("park", "pair", "--json"))
    assert "already parked" in _one_line_error(sg("park", "pair"))
    ok_json(sg("unpark", "pair", "--json"))
    gate.touch()
    _wait(lambda: "done" in _lines(state_dir, "pair"), "the pair to finish")
    assert _lines(state_dir, "pair") == EXPECTED


def test_failed_park_leaves_the_job_running_and_unrecorded(
    sg: Sg, state_dir: Path, config: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    config.write_text(
        config.read_text().replace(
            f'memory_dir = "{tmp_path / "shm" / "parked"}"', f'memory_dir = "{blocker}/parked"'
        )
    )
    ok_json(sg("run", "--name", "pair", "--json", "--", sys.executable, JOBS, "pair", str(STEPS)))
    _wait(lambda: len(_lines(state_dir, "pair")) >= 2, "the pair to make progress")
    res = sg("park", "pair", "--to", "tmpfs", "--json")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert record.load(state_dir, "pair") is None
    job = resolve_job("pair", state_dir=state_dir)
    assert proctree.alive(job.pid)
    _wait(lambda: "done" in _lines(state_dir, "pair"), "the pair to finish")
    assert _lines(state_dir, "pair") == EXPECTED
    assert json.loads((state_dir / "jobs" / "pair" / "job.json").read_text())["pid"] == job.pid


class _Hook(http.server.BaseHTTPRequestHandler):
    got: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.got.append(json.loads(body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, fmt: str, *args: object) -> None:
        return


def test_park_and_unpark_tell_the_webhooks(sg: Sg, state_dir: Path, config: Path) -> None:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/hook"
    config.write_text(config.read_text() + f'[notify]\nwebhook_url = ["{url}"]\n')
    try:
        ok_json(sg("run", "--name", "nb", "--json", "--", sys.executable, JOBS, "sleeper"))
        ok_json(sg("park", "nb", "--reason", "idle notebook", "--json"))
        ok_json(sg("unpark", "nb", "--json"))
    finally:
        srv.shutdown()
    events = [(n["event"], n["job"], n["source"]) for n in _Hook.got]
    assert events == [("parked", "nb", "park"), ("unparked", "nb", "park")]
    assert "idle notebook" in _Hook.got[0]["reason"]
    assert "spotguard unpark nb" in _Hook.got[0]["reason"]


@pytest.mark.parametrize("place", ["disk", "tmpfs"])
def test_an_open_sqlite_database_stays_writable_after_unpark(
    sg: Sg, state_dir: Path, tmp_path: Path, place: str
) -> None:
    """The carried file is rewritten in place (same inode): SQLite would turn read-only."""
    db = tmp_path / "history.sqlite"
    ok_json(sg("run", "--name", "db", "--json", "--", sys.executable, JOBS, "sqlite", str(db)))
    _wait(lambda: len(_lines(state_dir, "db")) >= 3, "rows to be written")
    ok_json(sg("park", "db", "--to", place, "--json"))
    ok_json(sg("unpark", "db", "--json"))
    n = len(_lines(state_dir, "db"))
    _wait(lambda: len(_lines(state_dir, "db")) >= n + 5, "rows after the unpark")
    assert not [ln for ln in _lines(state_dir, "db") if ln.startswith("ERROR")]
