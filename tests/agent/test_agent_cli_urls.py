"""``spotguard checkpoint --to URL`` and ``spotguard restore URL`` (through operations.py),
as real processes, end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import JOB_ARGS, Host, job_argv, job_output_when_done

from sgtest import sg, sg_json

pytestmark = pytest.mark.criu


async def spotguard(*args: str) -> dict[str, Any]:
    """``spotguard ARGS`` (:func:`sgtest.sg_json`) off the event loop."""
    return await asyncio.to_thread(sg_json, *args)


async def test_checkpoint_to_url_and_restore_from_latest(
    host: Host, tmp_path: Path, reference_output: str
) -> None:
    flags = ["--state-dir", str(host.state), "--shm-dir", str(host.shm), "--criu", host.criu]
    # the reference job at 0.15 s a step (10.5 s; its output does not depend on the pace):
    # at 0.05 s it ended before a loaded machine's `spotguard checkpoint` got to it
    argv = job_argv(*JOB_ARGS[:2], "--step-seconds", "0.15", *JOB_ARGS[4:])
    started = await spotguard("run", "--name", "train", "--json", *flags[:2], "--", *argv)
    store = f"file://{tmp_path}/store"
    pushed = await spotguard("checkpoint", "train", "--to", store, "--json", *flags)
    assert str(pushed["image_url"]).startswith(f"{store}/train/images/")
    assert pushed["mode"] == "exit" and int(str(pushed["bytes"])) > 0
    restored = await spotguard("restore", f"{store}/train/images/latest", "--json", *flags)
    assert restored["job"] == "train" and restored["image_url"] == pushed["image_url"]
    assert await job_output_when_done(Path(str(started["dir"]))) == reference_output


@pytest.mark.parametrize(
    ("to", "says"),
    [
        ("ftp://host/x", "unsupported store URL 'ftp://host/x'"),
        ("gcs://bucket/x", "unsupported store URL 'gcs://bucket/x'"),
        ("s3://", "names no bucket"),
        ("gs:///prefix", "names no bucket"),
        ("file://host/dir", "must be file:///absolute/path"),
    ],
)
async def test_a_destination_that_is_no_store_is_refused_before_the_job_is_touched(
    host: Host, tmp_path: Path, reference_output: str, to: str, says: str
) -> None:
    """A mistyped ``--to`` (an unknown scheme, a URL with no bucket) is bad input: one typed
    line, exit 2, before anything is done to the job — not a directory named ``ftp:`` made in
    the working directory with the job stopped into it, nor the job stopped and its image
    kept on the host for a store that can never take it. The job runs on to its end."""
    flags = ["--state-dir", str(host.state), "--shm-dir", str(host.shm), "--criu", host.criu]
    name = "typo-" + str(abs(hash(to)) % 1000)
    argv = job_argv(*JOB_ARGS[:2], "--step-seconds", "0.1", *JOB_ARGS[4:])
    started = await spotguard("run", "--name", name, "--json", *flags[:2], "--", *argv)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = await asyncio.to_thread(sg, "checkpoint", name, "--to", to, *flags, cwd=cwd, timeout=60)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spotguard: error:") and says in last, done.stderr
    assert not any(cwd.iterdir()), sorted(cwd.rglob("*"))  # nothing made here
    assert not host.shm.exists() or not any(host.shm.iterdir())  # nothing kept
    assert await job_output_when_done(Path(str(started["dir"]))) == reference_output
    refused = await asyncio.to_thread(
        sg, "restore", f"{to.rstrip('/')}/{name}/images/latest", *flags, cwd=cwd, timeout=60
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("spotguard: error:")
