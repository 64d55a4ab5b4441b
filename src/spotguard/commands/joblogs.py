"""``spotguard logs JOB [-f]``: a job's output, as ``spotguard run`` and restores keep it.

A job's ``stdout`` and ``stderr`` live in ``<state_dir>/jobs/<name>/`` and travel inside its
images, so after a restore the files hold everything the job printed on every VM. The job's
stdout goes to this command's stdout, its stderr to stderr. ``-f`` follows both until Ctrl-C
or, with ``--until-exit``, until the job's command has ended; a file replaced by a restore is
picked up where it was left (the restored file starts with what was already shown).

Exit status: 0; 1 no such job (one line naming the jobs there are); 2 bad usage.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import click

from spotguard.checkpoint.jobs import JobInfo, exit_status, list_jobs, resolve_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.cli import config
from spotguard.config import load, options
from spotguard.errors import JobNotFound
from spotguard.statedir import StateDir

__all__ = ["Follower", "logs", "tail_lines"]

POLL_S = 0.2
_STREAMS = ("stdout", "stderr")


def tail_lines(path: Path, n: int) -> tuple[bytes, int]:
    """The last ``n`` lines of ``path`` (all with ``n < 0``) and the offset of its end."""
    try:
        with path.open("rb") as f:
            if n < 0:
                data = f.read()
                return data, f.tell()
            last: deque[bytes] = deque(f, maxlen=n) if n else deque()
            return b"".join(last), f.tell()
    except FileNotFoundError:
        return b"", 0


@dataclass
class Follower:
    """Follows one output file by offset. A restore that replaces the file keeps the offset
    (the restored file starts with the output already shown); a shorter file starts over."""

    path: Path
    out: IO[bytes]
    offset: int = 0

    def poll(self) -> bool:
        """Copy what was appended since the last poll; True if anything was."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        if st.st_size < self.offset:  # truncated, or replaced by a shorter file
            self.offset = 0
        if st.st_size == self.offset:
            return False
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        self.offset += len(data)
        self.out.write(data)
        self.out.flush()
        return True


def _job(name: str, state_dir: Path) -> JobInfo:
    try:
        return resolve_job(name, state_dir=state_dir)
    except JobNotFound:
        known = ", ".join(j.name for j in list_jobs(state_dir)) or "none"
        raise JobNotFound(
            f"no job {name!r} under {StateDir(state_dir).jobs} (jobs there: {known}); "
            "set --state-dir / SPOTGUARD_STATE_DIR if it runs elsewhere"
        ) from None


def _sinks(which: str) -> dict[str, IO[bytes]]:
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    return {s: outs[s] for s in _STREAMS if which in (s, "both")}


@click.command("logs")
@click.argument("job")
@click.option("-f", "--follow", is_flag=True, help="Keep printing output as the job writes it.")
@click.option(
    "-n",
    "--lines",
    type=int,
    default=-1,
    help="Only the last N lines of each stream (default: all).",
)
@click.option(
    "--stream",
    "which",
    type=click.Choice(["both", "stdout", "stderr"]),
    default="both",
    show_default=True,
    help="Which of the job's outputs.",
)
@click.option("--until-exit", is_flag=True, help="With -f: stop once the job's command ended.")
@options(
    CheckpointSettings,
    exclude=tuple(n for n in CheckpointSettings.model_fields if n != "state_dir"),
)
@click.pass_context
def logs(
    ctx: click.Context,
    /,
    job: str,
    follow: bool,
    lines: int,
    which: str,
    until_exit: bool,
    **flags: Any,
) -> None:
    """Print JOB's output (stdout and stderr of a job started with ``spotguard run``).

    Example: spotguard logs train -f -n 20
    """
    state_dir = load(CheckpointSettings, flags, config_file=config(ctx)).state_dir
    info = _job(job, state_dir)
    followers = []
    for stream, sink in _sinks(which).items():
        data, end = tail_lines(info.dir / stream, lines)
        sink.write(data)
        sink.flush()
        followers.append(Follower(info.dir / stream, sink, offset=end))
    if not follow:
        return
    try:
        while True:
            ended = until_exit and exit_status(info) is not None
            for f in followers:  # after the exit status: everything the job wrote is there
                f.poll()
            if ended:
                return
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        return
