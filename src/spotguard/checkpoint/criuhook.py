"""The post-dump hook of a CRIU dump: CRIU's action script waits, with the tree frozen and
the image written, for the owner of the dump (the engine) to say whether CRIU may go on to
resume or kill the tree (``on_frozen``: spotguard snapshots the job's files, commits an exit
image, drains a leave-running one's pipes there).

The script and the owner talk over two FIFOs in a work directory of the owner's. The script
also watches CRIU and the owner (pid and start time): a dump's CRIU outlives an owner killed
part-way (:mod:`.criu`), and the hook is how it learns that nobody is there to keep the image
— the watcher kills the script, CRIU takes that for a "no" and resumes the tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import Awaitable, Callable

from spotguard import workdirs

from .procfacts import start_time

#: runs under /bin/sh for every CRIU action; only post-dump talks to us. Opening a FIFO
#: waits for its other end: with the owner gone (killed, or its hook closed while CRIU ran
#: on) nobody ever opens it, so a watcher ends the script once CRIU, its parent, or the owner
#: (``SPOTGUARD_HOOK_OWNER``: pid and start time, field 22 of /proc/PID/stat) is gone — CRIU
#: then takes the killed script for a "no" and resumes the tree (never waits for ever with
#: the job frozen, never kills a job whose image nobody keeps)
_ACTION_SCRIPT = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = "post-dump" ] || exit 0
[ -n "$SPOTGUARD_HOOK_REQ" ] || exit 0
criu=$PPID
owner=${SPOTGUARD_HOOK_OWNER%%:*}
born=${SPOTGUARD_HOOK_OWNER#*:}
started() {
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  set -- ${s##*) }
  echo "${20}"
}
alive() { kill -0 "$criu" 2>/dev/null && [ "$(started "$owner")" = "$born" ]; }
alive || exit 1
( while alive; do sleep 0.2; done; kill -9 "$$" 2>/dev/null ) &
watcher=$!
rc=1
if echo frozen > "$SPOTGUARD_HOOK_REQ" && read -r reply < "$SPOTGUARD_HOOK_ACK"; then
  [ "$reply" = ok ] && rc=0
fi
kill "$watcher" 2>/dev/null
exit $rc
"""


async def nothing() -> None:
    """The post-dump hook of a dump whose caller has nothing to do while the tree is frozen."""


class FrozenHook:
    """The FIFO pair through which CRIU's post-dump action script waits for the engine."""

    def __init__(self, callback: Callable[[], Awaitable[None]]) -> None:
        self.callback = callback
        self.dir = workdirs.make("spotguard-criu-")
        self.script = self.dir / "action.sh"
        self.script.write_text(_ACTION_SCRIPT)
        self.script.chmod(0o700)
        self.req = self.dir / "req"
        self.ack = self.dir / "ack"
        os.mkfifo(self.req, 0o600)
        os.mkfifo(self.ack, 0o600)
        # O_RDWR keeps a writer/reader of our own open: no EOF storms, no lost answer.
        self.req_fd = os.open(self.req, os.O_RDWR | os.O_NONBLOCK)
        self.ack_fd = os.open(self.ack, os.O_RDWR | os.O_NONBLOCK)
        self.called = False
        self.error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None

    def env(self) -> dict[str, str]:
        me = os.getpid()
        return {
            "SPOTGUARD_HOOK_REQ": str(self.req),
            "SPOTGUARD_HOOK_ACK": str(self.ack),
            "SPOTGUARD_HOOK_OWNER": f"{me}:{start_time(me)}",
        }

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(self.req_fd, ready.set)
        try:
            await ready.wait()
        finally:
            loop.remove_reader(self.req_fd)
        with contextlib.suppress(BlockingIOError):
            os.read(self.req_fd, 64)
        self.called = True
        reply = b"ok\n"
        try:
            await self.callback()
        except BaseException as exc:
            self.error = exc
            reply = b"fail\n"
            raise
        finally:
            os.write(self.ack_fd, reply)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        for fd in (self.req_fd, self.ack_fd):
            os.close(fd)
        shutil.rmtree(self.dir, ignore_errors=True)
