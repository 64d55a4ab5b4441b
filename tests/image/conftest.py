"""Fixtures for image tests: the real servers of tests/store/store_servers.py, plus CRIU jobs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgtest import store_servers

_m = store_servers()
gcs_server = _m.gcs_server  # type: ignore[attr-defined]
gcs_bucket = _m.gcs_bucket  # type: ignore[attr-defined]
s3_bucket = _m.s3_bucket  # type: ignore[attr-defined]
store_url = _m.store_url  # type: ignore[attr-defined]
fault_proxy = _m.fault_proxy  # type: ignore[attr-defined]


# --- a real job to checkpoint with CRIU -------------------------------------------------------


COUNTER = """
import os, sys, time, zlib
token = os.urandom(8).hex()          # lives only in this process's memory
blob = os.urandom(2 << 20)           # memory whose exact bytes must survive
crc = zlib.crc32(blob)
i = 0
p = sys.argv[1]
while True:
    i += 1
    with open(p + ".tmp", "w") as f:
        f.write(f"{token} {i} {zlib.crc32(blob)} {crc}")
    os.replace(p + ".tmp", p)
    time.sleep(0.01)
"""


class CounterJob:
    """A small process whose state (a random token, a counter, 2 MiB of random memory) shows
    whether a restore continued it exactly: same token, counter past the dump, same CRC."""

    def __init__(self, criu: str, workdir: Path) -> None:
        self.criu = criu
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count = self.dir / "count"
        (self.dir / "prog.py").write_text(COUNTER)
        self.pid: int | None = None

    def start(self) -> int:
        with (self.dir / "out.log").open("wb") as out, (self.dir / "err.log").open("wb") as err:
            proc = subprocess.Popen(
                ["/usr/bin/python3", str(self.dir / "prog.py"), str(self.count)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        self._proc = proc
        self.pid = proc.pid
        self.wait_for(lambda s: s[1] >= 5)
        return proc.pid

    def state(self) -> tuple[str, int, int, int]:
        token, i, crc_now, crc0 = self.count.read_text().split()
        return token, int(i), int(crc_now), int(crc0)

    def wait_for(self, cond: object, timeout: float = 20.0) -> tuple[str, int, int, int]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                s = self.state()
                if cond(s):  # type: ignore[operator]
                    return s
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"job state never matched; last {self.count.read_text()!r}")
            time.sleep(0.02)

    def dump(self, images: Path) -> tuple[str, int, int, int]:
        """criu dump (the job is killed, as when the VM goes away); returns its last state."""
        images.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                self.criu,
                "dump",
                "-t",
                str(self.pid),
                "-D",
                str(images),
                "-o",
                str(self.dir / "dump.log"),
                "-v2",
            ],
            check=True,
        )
        self._proc.wait(timeout=10)
        return self.state()

    def restore(self, images: Path) -> None:
        subprocess.run(
            [
                self.criu,
                "restore",
                "-D",
                str(images),
                "-d",
                "-o",
                str(self.dir / "restore.log"),
                "-v2",
            ],
            check=True,
        )

    def kill(self) -> None:
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)


@pytest.fixture
def counter_job(criu_bin: str, tmp_path: Path) -> Iterator[CounterJob]:
    job = CounterJob(criu_bin, tmp_path / "job")
    try:
        yield job
    finally:
        job.kill()
