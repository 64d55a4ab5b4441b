"""A runtime's CLI failing: one typed line, and where it names CRIU's log, that log's error
lines logged before the runtime removes them (runc's own message, "criu failed: type NOTIFY
errno 0", does not say what CRIU refused)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spotguard.container.runtime import run_tool
from spotguard.errors import ContainerError


async def test_a_failure_naming_crius_log_logs_its_error_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dump_log = tmp_path / "dump.log"
    dump_log.write_text(
        "(00.001) Version: 4.2.1\n"
        "(00.020) Error (criu/mount.c:753): mnt: 72:./x doesn't have a proper root mount\n"
        "(00.021) Error (criu/cr-dump.c:1979): Dumping FAILED.\n"
    )
    tool = tmp_path / "fake-podman"
    tool.write_text(
        "#!/bin/sh\n"
        f"echo 'level=error msg=\"criu failed: type NOTIFY errno 0\\nlog file: {dump_log}\"' >&2\n"
        "exit 125\n"
    )
    tool.chmod(0o755)
    with caplog.at_level(logging.WARNING), pytest.raises(ContainerError) as failed:
        await run_tool([str(tool)], env=None, limit=10, what="checkpointing x",
                       label="podman container checkpoint")  # fmt: skip
    assert "\n" not in str(failed.value) and "type NOTIFY" in str(failed.value)
    said = [r for r in caplog.records if r.getMessage() == "CRIU's log says"]
    assert said and "doesn't have a proper root mount" in said[0].__dict__["error"]
    assert said[0].__dict__["path"] == str(dump_log)


async def test_containerds_way_of_naming_crius_log_is_read_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ctr (containerd's shim) names the log as "path= PATH: unknown"."""
    dump_log = tmp_path / "criu-dump.log"
    dump_log.write_text("(00.020) Error (criu/cr-dump.c:1979): Dumping FAILED.\n")
    tool = tmp_path / "fake-ctr"
    tool.write_text(
        "#!/bin/sh\n"
        "echo 'ctr: /run/spotguard/containerd/runc did not terminate successfully: exit status 1:"
        f" criu failed: type NOTIFY errno 0 path= {dump_log}: unknown' >&2\n"
        "exit 1\n"
    )
    tool.chmod(0o755)
    with caplog.at_level(logging.WARNING), pytest.raises(ContainerError):
        await run_tool([str(tool)], env=None, limit=10, what="checkpointing x",
                       label="ctr tasks checkpoint")  # fmt: skip
    said = [r for r in caplog.records if r.getMessage() == "CRIU's log says"]
    assert said and "Dumping FAILED" in said[0].__dict__["error"]
    assert said[0].__dict__["path"] == str(dump_log)
