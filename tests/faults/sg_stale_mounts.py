"""A job started while the host had a network namespace mounted (as ``ip netns``, docker and
CNI do) and a tmpfs (a container's shm); the host then unmounts both and leaves their
mountpoints, as a stopped container does: the job's own namespace keeps stale copies of both.
Checkpoint the job, remove the mountpoints, restore it.

Run by tests/faults/test_faults_mounts.py as ``unshare -m --propagation private python THIS
DIR CRIU`` (nothing reaches the host's mount table). Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sg_mount_restore import COUNTER, STEPS, _Lines, _lines, _wait, kill_jobs

from spotguard import operations
from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import exit_status, start_job
from spotguard.checkpoint.settings import CheckpointSettings
from spotguard.contracts import Mode
from spotguard.image import ImageSettings
from spotguard.image.catalog import latest_image


def _stale_copies(job_pid: int, root: Path) -> list[str]:
    with open(f"/proc/{job_pid}/mountinfo") as f:
        return sorted(ln.split()[4] for ln in f if ln.split()[4].startswith(str(root)))


def _container_starts(netns: Path, shm: Path) -> subprocess.Popen[bytes]:
    """A network namespace mounted at ``netns`` (held by a sleeper) and a tmpfs at ``shm``."""
    netns.parent.mkdir()
    netns.touch()
    shm.mkdir(parents=True)
    holder = subprocess.Popen(["unshare", "-n", "--kill-child", "sleep", "120"])
    ours = os.readlink("/proc/self/ns/net")
    for _ in range(500):
        if os.readlink(f"/proc/{holder.pid}/ns/net") != ours:
            break
        time.sleep(0.01)
    subprocess.run(["mount", "--bind", f"/proc/{holder.pid}/ns/net", netns], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", shm], check=True)
    (shm / "segment").write_text("a container's\n")
    return holder


def _container_stops(netns: Path, shm: Path, holder: subprocess.Popen[bytes]) -> None:
    """Its mounts go from the host; their mountpoints stay."""
    subprocess.run(["umount", netns], check=True)
    subprocess.run(["umount", shm], check=True)
    holder.kill()
    holder.wait()


async def main(root: Path, criu: str) -> dict[str, Any]:
    handler = _Lines()
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    netns, shm = root / "netns" / "cni-1234", root / "userdata" / "shm"
    holder = _container_starts(netns, shm)
    settings = CheckpointSettings(
        state_dir=root / "state", shm_dir=root / "staging", criu=criu, criu_timeout=60
    )
    img = ImageSettings(chunk_size=1 << 20, workers=1, max_inflight_mb=4)
    store = f"file://{root / 'store'}"
    job = await start_job([sys.executable, "-c", COUNTER, str(STEPS)], "quiet",
                          state_dir=settings.state_dir, cwd=root)  # fmt: skip
    out: dict[str, Any] = {}
    try:
        await _wait(lambda: len(_lines(job)) > 5, "the job to count")
        _container_stops(netns, shm, holder)
        out["stale_in_job"] = _stale_copies(job.pid, root)
        try:
            await operations.checkpoint(
                job, store, mode=Mode.EXIT, settings=settings, image_settings=img
            )
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["checkpoint"] = f"{type(exc).__name__}: {exc}"
            return out
        out["checkpoint"] = "ok"
        await _wait(lambda: not proctree.alive(job.pid), "the job to stop")
        shutil.rmtree(root / "netns")
        shutil.rmtree(root / "userdata")
        url = await latest_image(store, job.name, settings=img)
        assert url is not None
        try:
            rr = await operations.restore(url, settings=settings, image_settings=img)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["restore"] = f"{type(exc).__name__}: {exc}"
            return out
        out["restore"] = "ok"
        await _wait(lambda: exit_status(rr.job) is not None, "the job to finish")
        out["exit"] = exit_status(rr.job)
        out["lines"] = _lines(job)
        out["left_on_host"] = sorted(os.listdir(root))
        out["log"] = handler.records
    finally:
        holder.kill()
        kill_jobs(settings.state_dir)
    return out


if __name__ == "__main__":
    os.environ.pop("SPOTGUARD_CONFIG", None)
    result = asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
    print(json.dumps(result))
