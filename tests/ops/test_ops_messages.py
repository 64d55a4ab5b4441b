"""Issue 17.2 and 17.7: every user-facing failure is one line that names the thing and what to
do, with the exit status docs/operations.md lists — never a traceback, never a quiet success."""

from __future__ import annotations

import subprocess
from pathlib import Path

from ops_helpers import as_nobody, clean_env, free_port, sg

NOT_RUNNING = (
    "spotguard: error: the spotguard agent is not running (nothing answers on {listen}): start "
    "it with 'systemctl start spotguard-agent' (or 'spotguard agent'); "
    "'journalctl -u spotguard-agent' says why it stopped\n"
)


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0] + "\n"


def install_hint(line: str, extra: str) -> str:
    """``line`` without its closing ``: install it with PYTHON -m pip install
    'spotguard[EXTRA]'`` hint, checked to name an existing Python interpreter (whichever runs
    spotguard: its path is not spelt here, so the test holds under any interpreter path)."""
    head, sep, hint = line.rstrip("\n").rpartition(": install it with ")
    assert sep, line
    python, _, command = hint.partition(" -m ")
    assert command == f"pip install 'spotguard[{extra}]'", line
    assert Path(python).name.startswith("python") and Path(python).is_file(), line
    return head


def test_status_without_an_agent_says_it_is_not_running(tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    r = sg("status", "--api-listen", listen, "--state-dir", str(tmp_path))
    assert r.returncode == 3
    assert one_line(r.stderr) == NOT_RUNNING.format(listen=listen)
    assert r.stdout == ""


def test_status_of_a_dead_agent_with_a_stale_token_and_socket(tmp_path: Path) -> None:
    """The agent died: its token file and unix socket path remain, nothing answers."""
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "api.token").write_text("stale\n")
    sock = tmp_path / "agent.sock"
    sock.touch()
    for cmd in ("status", "drain"):
        r = sg(cmd, "--api-listen", f"unix:{sock}", "--state-dir", str(tmp_path))
        assert r.returncode == 3, r.stderr
        assert one_line(r.stderr) == NOT_RUNNING.format(listen=f"unix:{sock}")


def test_images_list_of_a_missing_file_store_is_an_error(tmp_path: Path) -> None:
    r = sg("images", "list", "file:///nonexistent")
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        "spotguard: error: store file:///nonexistent: no directory /nonexistent (check the "
        "URL; a file store is file:///absolute/dir or a path)\n"
    )
    gc = sg("images", "gc", str(tmp_path / "nope"), "--keep", "1")
    assert gc.returncode == 1 and "no directory" in one_line(gc.stderr)
    empty = sg("images", "list", str(tmp_path))  # exists, holds nothing: not an error
    assert empty.returncode == 0 and empty.stdout == f"no images in {tmp_path}\n"


def test_run_as_non_root_is_one_line(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    r = as_nobody("run", "--name", "x", "--", "sleep", "1", cwd=tmp_path)
    assert r.returncode == 2  # docs/operations.md, "Exit codes": run without root is usage
    assert one_line(r.stderr) == (
        "spotguard: error: spotguard run needs root (the job's PID namespace and CRIU "
        "require it): run it with sudo\n"
    )


def test_restore_of_an_empty_name_is_a_usage_error(tmp_path: Path) -> None:
    r = sg("restore", "", "--state-dir", str(tmp_path))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == (
        "Error: Invalid value for IMAGE: is empty: give an image directory or a store URL "
        "(…/JOB/images/latest)"
    )


def test_a_store_without_its_extra_names_the_extra() -> None:
    r = sg("images", "list", "gs://bucket/prefix", without=("google",))
    assert r.returncode == 2
    assert install_hint(one_line(r.stderr), "gcp") == (
        "spotguard: error: store gs://bucket/prefix needs the 'gcp' extra, which is not "
        "installed (no module 'google.cloud.storage')"
    )


def test_the_agent_refuses_to_start_without_its_stores_extra(tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    r = sg(
        "agent",
        *("--job", "train", "--store", "s3://bucket/spotguard", "--cloud", "none"),
        *("--state-dir", str(tmp_path), "--api-listen", listen),
        without=("boto3", "botocore"),
        timeout=30,
    )
    assert r.returncode == 2
    assert install_hint(one_line(r.stderr), "aws") == (
        "spotguard: error: store s3://bucket/spotguard needs the 'aws' extra, which is not "
        "installed (no module 'boto3')"
    )
    assert not (tmp_path / "agent").exists(), "it did nothing before refusing"


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(tmp_path: Path) -> None:
    """An error no module maps (here: a broken install lacking a core dependency) is still
    one line; ``--log-level debug`` shows the traceback."""
    r = sg("images", "list", str(tmp_path), without=("zstandard",))
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        "spotguard: error: ModuleNotFoundError: No module named 'zstandard' "
        "(unexpected; --log-level debug shows where)\n"
    )
    d = sg("--log-level", "debug", "images", "list", str(tmp_path), without=("zstandard",))
    assert d.returncode == 1 and "Traceback" in d.stderr


def test_logs_of_an_unknown_job_names_the_jobs_there(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    r = sg("logs", "nope", "--state-dir", str(tmp_path))
    assert r.returncode == 1
    assert one_line(r.stderr) == (
        f"spotguard: error: no job 'nope' under {tmp_path / 'jobs'} (jobs there: none); "
        "set --state-dir / SPOTGUARD_STATE_DIR if it runs elsewhere\n"
    )


def test_shell_completion_comes_from_the_program() -> None:
    """docs/operations.md#shell-completion: click's completion through the lazy command group."""
    env = clean_env(_SPOTGUARD_COMPLETE="bash_complete", COMP_WORDS="spotguard lo", COMP_CWORD="1")
    r = subprocess.run(["spotguard"], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "plain,logs" in r.stdout.splitlines()
    src = sg(env=clean_env(_SPOTGUARD_COMPLETE="bash_source"))
    assert "_spotguard_completion()" in src.stdout
