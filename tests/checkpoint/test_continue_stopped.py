"""A restored tree that CRIU left stopped runs again (:func:`spotguard.checkpoint.suspend.
continue_stopped`), on real processes: whatever ``/proc`` shows at the instant it is read.

A stopped process that a tracer lets go (the placer's set-up injects into the restored job,
:mod:`spotguard.checkpoint.inject`) shows running for a moment before it stops again, and a
stop signal sent a moment ago shows in no state yet: a ``SIGCONT`` decided by that reading was
missed now and then, and the job stayed stopped for good."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from sgtest import wait_for
from spotguard.checkpoint import inject, suspend


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _pending(pid: int) -> int:
    """The process's pending signals (its own and its threads' shared set) as a bit mask."""
    with open(f"/proc/{pid}/status") as f:
        return sum(int(ln.split()[1], 16) for ln in f if ln.startswith(("SigPnd:", "ShdPnd:")))


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    if not inject.supported():
        pytest.skip("system calls are injected on x86-64 only")
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.01)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_stop_signal_sent_and_not_yet_acted_on_counts_as_stopped(
    sleeper: subprocess.Popen[bytes],
) -> None:
    with inject.Injector(sleeper.pid):  # held by a tracer: the stop waits, pending
        os.kill(sleeper.pid, signal.SIGSTOP)
        wait_for(lambda: _pending(sleeper.pid) & (1 << (signal.SIGSTOP - 1)), "SIGSTOP pending")
        assert _state(sleeper.pid) != "T"
        assert suspend.stopped(sleeper.pid)
        suspend.continue_stopped([sleeper.pid])
    wait_for(lambda: _state(sleeper.pid) in "RS", "the process running on")
    assert not suspend.stopped(sleeper.pid)


def test_a_tree_criu_left_stopped_runs_again_while_a_tracer_holds_it(
    sleeper: subprocess.Popen[bytes],
) -> None:
    os.kill(sleeper.pid, signal.SIGSTOP)
    wait_for(lambda: _state(sleeper.pid) == "T", "the process stopped")
    with inject.Injector(sleeper.pid):  # traced ('t'): not stopped as /proc says it
        suspend.continue_stopped([sleeper.pid], every=True)
    # let go by the tracer, it would go back to its stop (and stay) had SIGCONT been skipped
    wait_for(lambda: _state(sleeper.pid) in "RS", "the process running on")
    for _ in range(20):
        assert _state(sleeper.pid) != "T"
        os.sched_yield()


def test_a_running_process_gets_no_sigcont_unless_the_whole_tree_was_left_stopped() -> None:
    job = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.signal(signal.SIGCONT, lambda *a: print('cont', flush=True))\n"
            "print('ready', flush=True)\n"
            "time.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None and job.stdout.readline() == "ready\n"
        suspend.continue_stopped([job.pid])  # a running job's own SIGCONT handler stays quiet
        assert not select.select([job.stdout], [], [], 0.5)[0]
        suspend.continue_stopped([job.pid], every=True)
        assert job.stdout.readline() == "cont\n"
    finally:
        job.kill()
        job.wait()
