"""Work directories named after their owner: only those whose owner is gone are swept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sgtest import held_in_pid_namespace, run_in_pid_namespace
from spotguard import workdirs
from spotguard.checkpoint.procfacts import start_time


def test_only_the_work_directories_of_a_dead_owner_are_swept(tmp_path: Path) -> None:
    mine = workdirs.make("sg-dump-", tmp_path)  # this process: alive
    assert workdirs.owner(mine.name) is not None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    started = start_time(child.pid)
    child.kill()
    child.wait()
    ns = workdirs.pid_namespace()
    dead = tmp_path / f"spotguard-criu-{child.pid}.{started}.{ns}-abcd1234"
    dead.mkdir()
    (dead / "req").write_text("a FIFO once")
    reused = tmp_path / f"sg-serve-{mine.name.split('-')[2].split('.')[0]}.1.{ns}-abcd1234"
    reused.mkdir()  # a pid alive now, but not the process that made it (another start)
    foreign = [
        tmp_path / "sg-dump-abcd1234",
        tmp_path / "pip-unpack-1234.5-x",
        tmp_path / "x",
        tmp_path / f"sg-dump-{child.pid}.{started}-abcd1234",  # no namespace: an older name
        tmp_path / f"sg-dump-{child.pid}.{started}.{ns + 1}-abcd1234",  # another namespace
    ]
    for d in foreign:
        d.mkdir()
    assert sorted(workdirs.sweep(tmp_path)) == sorted([dead, reused])
    assert mine.is_dir() and all(d.is_dir() for d in foreign)


def test_an_unknown_prefix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="prefix"):
        workdirs.make("elsewhere-", tmp_path)


def test_the_empty_plugin_dir_of_a_killed_criu_user_is_swept(tmp_path: Path) -> None:
    """A ``Criu`` without plugins makes an empty ``--libdir`` of its own; a process killed
    while holding one left it for ever when it was not named after its owner."""
    code = (
        "import sys, time\n"
        "from spotguard.checkpoint.criu import Criu\n"
        "criu = Criu(sys.argv[1], plugins=None)\n"
        "print(criu._plugin_args()[1], flush=True)\n"
        "time.sleep(30)\n"
    )
    env = {"TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-c", code, "/bin/true"]  # any executable: CRIU is never run
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout is not None
    libdir = Path(child.stdout.readline().strip())
    assert libdir.parent == tmp_path and libdir.is_dir()
    child.kill()
    child.wait()
    assert workdirs.sweep(tmp_path) == [libdir]


def test_a_live_owner_in_another_pid_namespace_is_never_swept(tmp_path: Path) -> None:
    """An agent in a PID namespace of its own (a container, ``unshare -p``) that shares the
    temp dir sees none of the host's processes, and the host none of its: each took the
    other's running operations for dead and removed their work directories (a restore
    failed: "Can't create log file"). Only the sweeper's own namespace is judged."""
    # the host's live operation, swept from inside a namespace
    mine = workdirs.make("spotguard-restore-", tmp_path)
    removed = run_in_pid_namespace(
        "import sys; from pathlib import Path; from spotguard import workdirs\n"
        "print(len(workdirs.sweep(Path(sys.argv[1]))))\n",
        str(tmp_path),
    )
    assert removed == "0" and mine.is_dir(), "the namespace's sweep removed a live directory"
    # the namespace's live operation, swept from the host
    with held_in_pid_namespace(
        "import sys, time; from pathlib import Path; from spotguard import workdirs\n"
        "print(workdirs.make('sg-dump-', Path(sys.argv[1])), flush=True); time.sleep(60)\n",
        str(tmp_path),
    ) as made:
        theirs = Path(made)
        assert theirs.is_dir()
        assert workdirs.sweep(tmp_path) == []
        assert theirs.is_dir(), "the host's sweep removed a live work directory of a namespace"


def test_a_pid_namespace_that_kept_the_hosts_proc_sweeps_nothing(tmp_path: Path) -> None:
    """In a PID namespace without a /proc of its own the pids in names (its own) and those in
    /proc (the host's) differ: there an operation's own live directory — named after PID 1 —
    read as the host's init's, which started at another time, so as dead. Such a sweep must
    judge nothing."""
    out = run_in_pid_namespace(
        "import sys; from pathlib import Path; from spotguard import workdirs\n"
        "made = workdirs.make('sg-dump-', Path(sys.argv[1]))\n"
        "print(made.name, len(workdirs.sweep(Path(sys.argv[1]))))\n",
        str(tmp_path),
        own_proc=False,
    )
    name, removed = out.split()
    assert name.startswith("sg-dump-1.")  # PID 1 of its namespace
    assert removed == "0" and (tmp_path / name).is_dir(), "its own live directory was swept"
