"""Issue 28.5, the command line's output: an interactive command prints its result on stdout
and nothing else on stderr by default (no INFO lines with internal dicts); ``--verbose`` (or
``--log-level info``) brings the log lines back; ``park --help`` shows the park's own options,
not every CRIU setting. Real ``spotguard`` processes, real jobs, real CRIU."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ops_helpers import clean_env

from spotguard.checkpoint import proctree
from spotguard.checkpoint.jobs import list_jobs

LOOP = "import time\ni = 0\nwhile True:\n    print(i, flush=True); i += 1; time.sleep(0.05)\n"


@pytest.fixture
def conf(tmp_path: Path, criu_bin: str) -> Iterator[Path]:
    """A config with this test's own state dir, CRIU and staging; every job killed after."""
    state = tmp_path / "state"
    cfg = tmp_path / "spotguard.toml"
    cfg.write_text(
        f'[checkpoint]\nstate_dir = "{state}"\ncriu = "{criu_bin}"\n'
        f'shm_dir = "{tmp_path / "shm"}"\ncriu_timeout = 60\n'
        f'[park]\nmemory_dir = "{tmp_path / "shm" / "parked"}"\n'
        # no agent on this state dir: its API port must not be another test's agent
        f'[agent]\napi_listen = "unix:{tmp_path / "no-agent.sock"}"\n'
    )
    yield cfg
    for job in list_jobs(state):
        if proctree.alive(job.pid):
            proctree.signal_all([job.pid], 9)


def sgc(conf: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``spotguard ARGS`` with the test's config, as an operator types it."""
    return subprocess.run(
        ["spotguard", *args],
        capture_output=True,
        text=True,
        env=clean_env(SPOTGUARD_CONFIG=str(conf)),
        timeout=120,
    )


def ok(res: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert res.returncode == 0, f"exit {res.returncode}: {res.stdout}{res.stderr}"
    return res


def result_only(res: subprocess.CompletedProcess[str]) -> str:
    """The one result line on stdout, and no log line on stderr."""
    ok(res)
    assert res.stderr == "", f"stderr should hold no log lines by default:\n{res.stderr}"
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout
    return lines[0]


def info_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if " info " in ln]


def start(conf: Path, name: str) -> None:
    ok(sgc(conf, "run", "--name", name, "--nccl", "restrict", "--", sys.executable, "-c", LOOP))
    time.sleep(0.3)


def test_park_unpark_print_the_result_only_and_log_with_verbose(conf: Path) -> None:
    start(conf, "quiet")
    assert result_only(sgc(conf, "park", "quiet", "--to", "disk")).startswith(
        "job quiet parked to disk"
    )
    assert result_only(sgc(conf, "unpark", "quiet")).startswith("job quiet unparked from disk")
    loud = ok(sgc(conf, "park", "quiet", "--to", "disk", "--verbose"))
    assert loud.stdout.startswith("job quiet parked to disk")
    assert any("job parked" in ln for ln in info_lines(loud.stderr)), loud.stderr
    loud = ok(sgc(conf, "--log-level", "info", "unpark", "quiet"))
    assert any("job unparked" in ln for ln in info_lines(loud.stderr)), loud.stderr
    loud = ok(sgc(conf, "-v", "park", "quiet", "--to", "memory"))
    assert info_lines(loud.stderr), loud.stderr
    assert result_only(sgc(conf, "unpark", "quiet")).startswith("job quiet unparked from memory")


def test_checkpoint_restore_and_gc_print_the_result_only(conf: Path, tmp_path: Path) -> None:
    start(conf, "img")
    store = tmp_path / "store"
    store.mkdir()
    url = f"file://{store}"
    for _ in range(2):
        line = result_only(sgc(conf, "checkpoint", "img", "--to", url, "--leave-running"))
        assert line.startswith("job img checkpointed to")
    line = result_only(sgc(conf, "checkpoint", "img", "--to", url))
    assert line.startswith("job img checkpointed to")
    line = result_only(sgc(conf, "restore", f"{url}/img/images/latest"))
    assert line.startswith("job img restored from")
    line = result_only(sgc(conf, "images", "gc", url, "--keep", "1", "--trust-store"))
    assert line.startswith("deleted 2 image(s)")
    loud = ok(sgc(conf, "images", "gc", url, "--keep", "1", "--trust-store", "--verbose"))
    assert loud.stdout.startswith("deleted 0 image(s)")


def test_doctor_prints_its_checks_only(conf: Path) -> None:
    res = sgc(conf, "doctor")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stderr == "", res.stderr
    assert "self-test" in res.stdout
    loud = sgc(conf, "doctor", "--verbose")
    assert any("job frozen" in ln for ln in info_lines(loud.stderr)), loud.stderr


def test_park_help_names_the_park_options_not_every_criu_setting() -> None:
    out = ok(subprocess.run(["spotguard", "park", "--help"], capture_output=True, text=True))
    listed = out.stdout.split("Options:")[1].split("--help")[0]  # the options, not the epilog
    for flag in ("--to", "--wake-on-connect", "--reason", "--json", "--verbose", "--state-dir"):
        assert flag in listed, out.stdout
    advanced = ("--ghost-limit", "--gpu-lock-timeout", "--network-lock", "--pid-wait",
                "--manage-cgroups", "--memory-margin", "--nccl-shim", "--restore-gpus")  # fmt: skip
    for flag in advanced:
        assert flag not in listed, out.stdout
    assert "docs/agent.md" in out.stdout  # where the advanced ones are described
    assert len(out.stdout.splitlines()) < 40, out.stdout
    # hidden, still accepted
    ok(subprocess.run(["spotguard", "park", "--ghost-limit", "1", "--help"], capture_output=True))
