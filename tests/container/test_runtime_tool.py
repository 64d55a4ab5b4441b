"""A runtime's CLI failing: one typed line, and where it names CRIU's log, that log's error
lines logged before the runtime removes them (runc's own message, "criu failed: type NOTIFY
errno 0", does not say what CRIU refused)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from spotguard.container import runtime
from spotguard.container.runtime import run_tool
from spotguard.errors import ContainerError, RuntimeCriuError


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


async def test_a_runtimes_criu_failure_says_what_crius_log_refused_in_its_one_line(
    tmp_path: Path,
) -> None:
    """runc says only "criu failed: type NOTIFY errno 0"; the error a user sees carries CRIU's
    reason too (the log is gone soon after), not the summary line that says nothing."""
    dump_log = tmp_path / "criu-dump.log"
    dump_log.write_text(
        "(10.020) Error (compel/src/lib/infect.c:122): Unseizable non-zombie 4242 found, "
        "state D, err 0/0\n"
        "(10.021) Error (criu/cr-dump.c:1979): Dumping FAILED.\n"
    )
    tool = tmp_path / "fake-ctr"
    tool.write_text(
        "#!/bin/sh\n"
        "echo 'ctr: runc did not terminate successfully: exit status 1:"
        f" criu failed: type NOTIFY errno 0 path= {dump_log}: unknown' >&2\n"
        "exit 1\n"
    )
    tool.chmod(0o755)
    with pytest.raises(RuntimeCriuError) as failed:
        await run_tool([str(tool)], env=None, limit=10, what="checkpointing x",
                       label="ctr tasks checkpoint")  # fmt: skip
    said = str(failed.value)
    assert "\n" not in said and "type NOTIFY" in said
    assert "CRIU's log: " in said and "Unseizable non-zombie 4242 found, state D" in said
    assert "Dumping FAILED" not in said
    assert isinstance(failed.value, ContainerError) and failed.value.retryable


def _flaky(tmp_path: Path, first: str) -> tuple[Path, Path]:
    """A runtime whose first run fails saying ``first`` on stderr, and whose later runs
    succeed printing their arguments; each run leaves its arguments in the returned count
    file."""
    count = tmp_path / "runs"
    tool = tmp_path / "fake-runtime"
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {count}\n'
        f"if [ $(wc -l < {count}) -eq 1 ]; then echo '{first}' >&2; exit 1; fi\n"
        'echo "$*"\n'
    )
    tool.chmod(0o755)
    return tool, count


def _runs(count: Path) -> list[str]:
    return count.read_text().splitlines()


async def _checkpoint_with(tool: Path, label: str) -> str:
    return await run_tool([str(tool)], env=None, limit=10, what="checkpointing x", label=label)


async def test_a_checkpoint_whose_criu_failed_is_tried_once_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime, "CRIU_RETRY_S", 0.01)
    tool, count = _flaky(tmp_path, "criu failed: type NOTIFY errno 0")
    with caplog.at_level(logging.WARNING):
        out = await runtime.once_more_if_criu_failed(
            lambda: _checkpoint_with(tool, "docker checkpoint create"), job="j"
        )
    assert out.strip() == ""  # the second run's (empty) arguments
    assert len(_runs(count)) == 2
    [again] = [r for r in caplog.records if "once more" in r.getMessage()]
    assert again.__dict__["job"] == "j" and "type NOTIFY" in again.__dict__["error"]


async def test_other_runtime_failures_and_a_second_criu_failure_are_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime, "CRIU_RETRY_S", 0.01)
    tool, count = _flaky(tmp_path, "Error: no such container x")
    with pytest.raises(ContainerError, match="no such container") as failed:
        await runtime.once_more_if_criu_failed(
            lambda: _checkpoint_with(tool, "podman container checkpoint"), job="j"
        )
    assert not isinstance(failed.value, RuntimeCriuError)
    assert len(_runs(count)) == 1  # not tried again

    calls = 0

    async def always() -> str:
        nonlocal calls
        calls += 1
        raise RuntimeCriuError(f"checkpointing x: criu failed ({calls})")

    with pytest.raises(RuntimeCriuError, match=r"\(2\)"):
        await runtime.once_more_if_criu_failed(always, job="j")
    assert calls == 2


async def test_each_runtimes_checkpoint_is_tried_once_more_after_its_criu_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring: containerd's ``ctr tasks checkpoint``, docker's ``checkpoint create`` (its
    partial checkpoint from the failed try removed) and podman's leave-running export each run
    the runtime twice when its CRIU failed the first time."""
    from spotguard.container.checkpoint import Export
    from spotguard.container.containerd import Containerd
    from spotguard.container.docker import Docker
    from spotguard.container.podman import Podman
    from spotguard.container.spec import ContainerRef
    from spotguard.image import ImageSettings
    from spotguard.image.writer import ImageWriter

    monkeypatch.setattr(runtime, "CRIU_RETRY_S", 0.01)
    said = "criu failed: type NOTIFY errno 0"

    ctr_dir = tmp_path / "ctr"
    ctr_dir.mkdir()
    tool, count = _flaky(ctr_dir, said)
    ctrd = Containerd(str(tool), tmp_path / "sock", "/bin/true", "/bin/true", ctr_dir / "rt")
    ref = ContainerRef.parse("containerd:ns/box")
    out = await ctrd.checkpoint_task(ref, leave_running=False)
    assert [r.split()[-3:] for r in _runs(count)] == [["checkpoint", "--exit", "box"]] * 2
    assert out.split()[-1] == "box"

    docker_dir = tmp_path / "docker"
    (docker_dir / "into" / "cp").mkdir(parents=True)
    (docker_dir / "into" / "cp" / "partial").write_text("left by a failed try")
    tool, count = _flaky(docker_dir, said)
    docker = Docker(
        str(tool), "unix:///x.sock", "/bin/true", "/bin/true", runtime_dir=docker_dir / "rt"
    )
    await docker.checkpoint("box", "docker-box", docker_dir / "into", "cp")
    assert len(_runs(count)) == 2 and "checkpoint create" in _runs(count)[1]
    assert not (docker_dir / "into" / "cp").exists()  # the failed try's part removed

    podman_dir = tmp_path / "podman"
    podman_dir.mkdir()
    tool, count = _flaky(podman_dir, said)
    podman = Podman(str(tool), "/bin/true", "/bin/true", runtime_dir=podman_dir / "rt")
    writer = ImageWriter(f"file://{tmp_path / 'store'}", "podman-box", settings=ImageSettings())
    export = Export(podman, ContainerRef.parse("podman:box"), podman_dir, writer, streamed=False)
    await export.run(["--leave-running"])
    assert len(_runs(count)) == 2 and "checkpoint box --export" in _runs(count)[1]


def _exporting(tmp_path: Path, first: str, *, export_first: bool) -> tuple[Path, Path]:
    """A podman whose runs write "archive" to the path after ``--export``, except its first
    run, which fails saying ``first`` (after writing there too when ``export_first``)."""
    count = tmp_path / "runs"
    tool = tmp_path / "fake-podman"
    first_export = 'echo archive > "$to"; ' if export_first else ""
    tool.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {count}\n'
        'to=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = --export ] && to=$a; prev=$a; done\n'
        f"if [ $(wc -l < {count}) -eq 1 ]; then {first_export}echo '{first}' >&2; exit 1; fi\n"
        'echo archive > "$to"\n'
    )
    tool.chmod(0o755)
    return tool, count


@pytest.mark.parametrize("export_first", [False, True], ids=["criu-failed", "podman-exported"])
async def test_a_streamed_podman_export_is_tried_again_only_if_podman_never_wrote_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, export_first: bool
) -> None:
    """Streamed, podman exports into a FIFO the image writer reads. CRIU dumps before podman
    exports, so a CRIU failure with nothing read is tried once more and the second export is
    what the image gets; had podman written to the FIFO, it is not tried again."""
    from spotguard.container.checkpoint import Export
    from spotguard.container.podman import Podman
    from spotguard.container.spec import ContainerRef
    from spotguard.image import ImageSettings
    from spotguard.image.writer import ImageWriter

    monkeypatch.setattr(runtime, "CRIU_RETRY_S", 0.01)
    tool, count = _exporting(
        tmp_path, "criu failed: type NOTIFY errno 0", export_first=export_first
    )
    podman = Podman(str(tool), "/bin/true", "/bin/true", runtime_dir=tmp_path / "rt")
    work = tmp_path / "work"
    work.mkdir()
    writer = ImageWriter(f"file://{tmp_path / 'store'}", "podman-box", settings=ImageSettings())
    async with writer:
        export = Export(podman, ContainerRef.parse("podman:box"), work, writer, streamed=True)
        if export_first:
            with pytest.raises(ContainerError, match="type NOTIFY") as failed:
                await export.run([])
            assert not isinstance(failed.value, RuntimeCriuError)
            assert len(_runs(count)) == 1
            return
        await export.run([])
        assert await export.into_image() == len("archive\n")
        assert len(_runs(count)) == 2
