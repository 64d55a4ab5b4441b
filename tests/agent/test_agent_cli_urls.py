"""``spotguard checkpoint --to URL`` and ``spotguard restore URL`` (through operations.py),
as real processes, end to end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import JOB_ARGS, Host, job_argv, job_output_when_done

from sgtest import sg_json

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
