"""Issue 28.5, ``spotguard status``: a parked job appears once (its row says where it is
parked), and a job whose images the agent did not write itself (written before the agent
started, by ``spotguard checkpoint``) shows its newest image from the store, not
"last image - (never)". A real agent process, real jobs, real CRIU, a file store."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_helpers import clean_env

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs
from spotguard.park import record

pytestmark = pytest.mark.criu

LOOP = "import time\ni = 0\nwhile True:\n    print(i, flush=True); i += 1; time.sleep(0.05)\n"


@pytest.fixture
def conf(tmp_path: Path, criu_bin: str) -> Iterator[Path]:
    state = tmp_path / "state"
    store = tmp_path / "store"
    store.mkdir()
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{state}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\ncriu_timeout = 60\n'
        f'[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
        f'[agent]\nstore = "{store.as_uri()}"\napi_listen = "unix:{tmp_path / "agent.sock"}"\n'
        "discover_interval_s = 0.2\nperiodic_interval = 0\n"
        '[notices]\ncloud = "none"\n'
    )
    yield cfg
    for rec in record.all_records(state):
        if rec.waker_pid and proctree.alive(rec.waker_pid):
            proctree.signal_all([rec.waker_pid], 9)
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], 9)


def sgc(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["spotguard", *args], capture_output=True, text=True,
                          env=clean_env(SPOTGUARD_CONFIG=str(conf)), timeout=120)  # fmt: skip


def ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, f"exit {res.returncode}: {res.stdout}{res.stderr}"
    return res.stdout


@pytest.fixture
def agent(conf: Path, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(["spotguard", "agent"], env=clean_env(SPOTGUARD_CONFIG=str(conf)),
                            stdout=log, stderr=log)  # fmt: skip
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def until_status(conf: Path, cond: object, what: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        res = sgc(conf, "status")
        if res.returncode == 0 and cond(res.stdout):  # type: ignore[operator]
            return res.stdout
        if time.monotonic() > deadline:
            pytest.fail(f"status never showed {what}: {res.stdout}{res.stderr}")
        time.sleep(0.2)


def rows(out: str, job: str) -> list[str]:
    return [ln for ln in out.splitlines() if ln.split()[:1] == [job]]


def test_status_shows_store_images_and_a_parked_job_once(
    conf: Path, tmp_path: Path, agent: subprocess.Popen[bytes]
) -> None:
    ok(sgc(conf, "run", "--name", "nb", "--nccl", "restrict", "--", sys.executable, "-c", LOOP))
    out = until_status(conf, lambda o: rows(o, "nb"), "the job protected")
    # an image the agent did not write: the newest in the store is shown
    ok(sgc(conf, "checkpoint", "nb", "--to", (tmp_path / "store").as_uri(), "--leave-running"))
    image = next((tmp_path / "store" / "nb" / "images").iterdir()).name
    out = until_status(conf, lambda o: image in o, "the store's image")
    (row,) = rows(out, "nb")
    assert "(never)" not in row and "last image -" not in row, out
    ok(sgc(conf, "park", "nb", "--to", "memory", "--reason", "lunch"))
    out = until_status(conf, lambda o: "parked" in o, "the job parked")
    (row,) = rows(out, "nb")  # once, not as a protected job and again as a parked one
    assert "parked in memory" in row and "lunch" in row, out
    ok(sgc(conf, "unpark", "nb"))
    out = until_status(conf, lambda o: "parked" not in o, "the job unparked")
    assert len(rows(out, "nb")) == 1, out
