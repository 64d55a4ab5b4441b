"""A process that runs ``criu dump`` the way the agent does and can be killed in the middle.

``python dump_owner.py PID IMAGES WHERE CRIU`` dumps the tree of PID (exit mode: CRIU kills
the tree once the image is written and the post-dump hook said yes) with one process at a
time (no page workers, so the parasite stays in the task while its pages are written), and
stalls where WHERE says, writing ``IMAGES/stalled`` once it is there:

- ``pages``: a streamed dump whose capture (holding 2 MiB) never takes the pages of the
  first task: CRIU blocks on a full pipe with its parasite inside that task;
- ``hook``: a dump to the directory whose post-dump hook (``on_frozen``) never returns: the
  image is written and CRIU waits for the owner's answer with the tree frozen.

The test then kills this process: the dump has lost its owner.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from spotguard.checkpoint import mounts
from spotguard.checkpoint.criu import Criu
from spotguard.checkpoint.jobs import own_mount_ns
from spotguard.stream.capture import Capture, FileOut
from spotguard.stream.local import DirSink

#: a capture that holds little: CRIU blocks on the stalled pages, its parasite in the task
#: (with the default 256 MiB the capture would take the whole image and CRIU would go on)
SMALL = {"piece_bytes": 1 << 20, "buffer_bytes": 2 << 20, "pipe_bytes": 1 << 20}


class _Stalled:
    """A file that never takes a byte (its first write waits for ever)."""

    def __init__(self, mark: Path) -> None:
        self.mark = mark

    async def write(self, data: memoryview) -> None:
        self.mark.touch()
        await asyncio.Event().wait()

    async def close(self) -> None:
        return None


class _StallPages:
    """A capture sink that writes every image file but the pages, which stall."""

    def __init__(self, images: Path) -> None:
        self.inner = DirSink(images / "out")
        self.mark = images / "stalled"

    def file(self, name: str) -> FileOut:
        if name.startswith("pages-"):
            return _Stalled(self.mark)
        return self.inner.file(name)


async def main(pid: int, images: Path, where: str, criu_bin: str) -> None:
    criu = Criu(criu_bin, page_workers=0, log_level=4)
    # the job's mount namespace as the engine names it: its copies of the host's mounts are
    # external (else CRIU tars every tmpfs in it, /dev/shm included, which other tests change)
    ns = own_mount_ns(pid)
    ext = mounts.survey(pid).dump_args() if ns else ()
    if where == "pages":
        async with Capture(images, _StallPages(images), **SMALL):
            await criu.dump(
                pid, images, leave_running=False, stream=True, mount_ns=ns, external_mounts=ext
            )
        return

    async def hang() -> None:
        (images / "stalled").touch()
        await asyncio.Event().wait()

    await criu.dump(
        pid, images, leave_running=False, on_frozen=hang, mount_ns=ns, external_mounts=ext
    )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]))
