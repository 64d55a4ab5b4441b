"""``spotguard doctor``'s self-test parks and unparks a job with a listening and an
established loopback TCP socket on this host (real CRIU), and says exactly what to do when
that fails."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spotguard.checkpoint import selftest_job
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.selftest import advice, run_selftest
from spotguard.errors import CriuError, StepTimeout

pytestmark = pytest.mark.criu


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The self-test's scratch directories go under this test's own directory: other tests
    (``spotguard doctor`` in other files, on other test workers) run self-tests at the same
    time, and what this one left is told apart by where it lives."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _leftovers(root: Path) -> set[Path]:
    return set(root.glob("spotguard-selftest-*"))


def _selftest_pids(root: Path) -> list[int]:
    """Live self-test jobs with a file open under ``root`` (their output, in the scratch)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"selftest_job.py" not in cmd:
                    continue
                fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
            except OSError:
                continue
            if any(f.startswith(str(root)) for f in fds):
                out.append(int(proc.name))
    return out


async def test_self_test_parks_and_unparks_a_job_with_sockets(criu_bin: str, scratch: Path) -> None:
    before = _leftovers(scratch)
    result = await run_selftest(Criu(criu_bin))
    assert result.ok, f"{result.found} / {result.fix}"
    assert result.found.startswith(
        "dumped and restored a 2-process job with a listening TCP socket, an established "
        "loopback connection and a socketpair; output exact (network lock "
    )
    assert _leftovers(scratch) == before and _selftest_pids(scratch) == []


async def test_a_failing_self_test_says_what_to_do_and_leaves_nothing(
    criu_bin: str, scratch: Path
) -> None:
    if shutil.which("iptables-restore"):
        pytest.skip("iptables is installed here: the iptables lock would work")
    before = _leftovers(scratch)
    result = await run_selftest(Criu(criu_bin), network_lock="iptables")
    assert not result.ok
    assert result.found == "failed: criu dump failed (criu exit 1)"
    assert result.fix == (
        "CRIU's network lock needs iptables, which is missing: enable nf_tables in the kernel "
        '(network_lock = "nftables") or install iptables'
    )
    assert _leftovers(scratch) == before and _selftest_pids(scratch) == []


def test_the_self_test_job_prints_what_its_expected_output_says() -> None:
    argv = [sys.executable, "-I", selftest_job.__file__, "25", "0"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout == selftest_job.expected(25)


def test_advice_reads_criu_log_tails() -> None:
    old = CriuError("criu dump failed", log_tail="Error (criu/sockets.c:1): Can't get 1:16 opt: "
                    "Operation not supported", log_path="/x/criu-dump.log")  # fmt: skip
    assert advice(old) == (
        "this CRIU cannot dump inet sockets on this kernel: install CRIU >= 4.2.1 with "
        "scripts/install-criu"
    )
    pids = CriuError("criu restore failed", log_tail="cr-restore.c: Can't fork for 7: File exists")
    assert advice(pids).startswith("a PID the image needs is taken")
    assert advice(StepTimeout("criu dump ran past 60 s")).startswith("CRIU ran past its time")
    other = CriuError("criu dump failed", log_tail="something new", log_path="/x/criu-dump.log")
    assert advice(other) == "read CRIU's log /x/criu-dump.log and run 'criu check --all' as root"


def test_doctor_cli_reports_the_self_test(criu_bin: str) -> None:
    env = {**os.environ, "SPOTGUARD_CRIU": criu_bin}
    spotguard = str(Path(sys.executable).parent / "spotguard")
    out = subprocess.run([spotguard, "doctor", "--json"], capture_output=True, text=True,
                         env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    checks = {c["name"]: c for c in json.loads(out.stdout)}
    assert checks["self-test"]["ok"] and "output exact" in checks["self-test"]["found"]
    out = subprocess.run([spotguard, "doctor", "--no-self-test"], capture_output=True,
                         text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "self-test" not in out.stdout
