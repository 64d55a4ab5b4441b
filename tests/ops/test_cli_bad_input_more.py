"""Bad input met by a new user's mistakes: every one is one typed line on stderr and exit 2
(docs/operations.md, "Exit codes") — never a traceback, an ``unexpected`` line of a Python
exception's name, a quiet success, or exit 1 as for a failure of the work itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sgtest import free_port, sg

#: Not UTF-8: what a binary file (a key in DER, a gzipped user-data, a wrong path) holds.
BINARY = b"\xff\xfe\x00garbage"


def refused(r: subprocess.CompletedProcess[str], *says: str) -> str:
    """The one line a refused command printed (exit 2), checked to hold every ``says``."""
    assert "Traceback" not in r.stderr, r.stderr
    assert "unexpected" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr
    assert lines, r.stderr
    for text in says:
        assert text in lines[-1], r.stderr
    return lines[-1]


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    path = tmp_path / "binary"
    path.write_bytes(BINARY)
    return path


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def test_a_config_file_that_is_not_text(binary: Path, state: Path) -> None:
    r = sg("status", "--state-dir", str(state), config=binary)
    assert refused(r) == (
        f"spotguard: error: config file {binary} is not valid TOML: it is not UTF-8 text "
        "(byte 0xff at 0)"
    )


def test_an_empty_state_dir_is_not_the_working_directory(tmp_path: Path) -> None:
    """``--state-dir ''`` was the working directory: ``run`` made ``./jobs`` there (and
    tightened the directory's mode to 0700); ``logs`` looked in ``./jobs``."""
    tmp_path.chmod(0o755)
    for args in (("logs", "x"), ("park", "x"), ("run", "--name", "x")):
        r = sg(*args, "--state-dir", "", *(["--", "true"] if args[0] == "run" else []),
               cwd=tmp_path)  # fmt: skip
        refused(r, "state_dir", "empty")
    assert list(tmp_path.iterdir()) == []
    assert tmp_path.stat().st_mode & 0o777 == 0o755


def test_metadata_sim_user_data_that_is_not_text(binary: Path) -> None:
    r = sg("metadata-sim", "--port", "0", "--user-data", f"@{binary}", timeout=30)
    refused(r, f"user-data file {binary}", "not UTF-8 text")


@pytest.mark.parametrize("url", ["garbage", "ftp://x", "http://", "http://127.0.0.1:99999"])
def test_notice_with_a_malformed_sim_url(url: str) -> None:
    r = sg("notice", "--sim", url, "list")
    refused(r, repr(url))


@pytest.mark.parametrize("url", ["garbage", "ftp://x", "http://127.0.0.1:99999"])
def test_jobs_and_migrate_with_a_malformed_controller_url(url: str) -> None:
    for args in (("jobs", "list"), ("migrate", "x", "--to", "us-west-2")):
        r = sg(*args, "--controller-url", url)
        refused(r, f"controller URL {url!r}")


def test_controller_issue_token_for_a_bad_job_name(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 40)
    key = tmp_path / "key"
    key.write_text("k" * 64)
    env = {"SPOTGUARD_CONTROLLER_TOKEN_FILE": str(token), "SPOTGUARD_VM_TOKEN_KEY_FILE": str(key)}
    r = sg("controller", "--state-dir", str(tmp_path), "--issue-token", "../x", env=env)
    refused(r, "--issue-token", "invalid job name '../x'")


def test_token_files_that_are_not_text(binary: Path, tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 64)
    env = {"SPOTGUARD_VM_TOKEN_KEY_FILE": str(key)}
    r = sg("controller", "--state-dir", str(tmp_path), "--controller-token-file", str(binary),
           env=env)  # fmt: skip
    refused(r, str(binary), "not UTF-8 text")
    r = sg("jobs", "list", "--controller-token-file", str(binary))
    refused(r, str(binary), "not UTF-8 text")


def agent(state: Path, *args: str) -> list[str]:
    listen = f"127.0.0.1:{free_port()}"
    return ["agent", "--cloud", "none", "--api-listen", listen, "--state-dir", str(state),
            "--store", str(state / "store"), *args]  # fmt: skip


def test_agent_refuses_files_that_are_not_text(binary: Path, state: Path) -> None:
    for flag in ("--assignment", "--api-token-file"):
        r = sg(*agent(state, flag, str(binary)), timeout=30)
        refused(r, str(binary), "not UTF-8 text")


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:port"])
def test_agent_refuses_a_controller_url_with_a_bad_port(url: str, state: Path) -> None:
    r = sg(*agent(state, "--controller-url", url), timeout=30)
    refused(r, f"controller URL {url!r}")


def test_agent_refuses_a_job_name_that_can_never_be(state: Path) -> None:
    """It retried ``../x`` forever ("job not found; retrying"): no job can have that name."""
    r = sg(*agent(state, "--job", "../x"), timeout=30)
    refused(r, "invalid job name '../x'")


@pytest.mark.parametrize("bucket", ["b%zz", "b" * 300, "user@b"])
def test_a_store_url_with_an_impossible_bucket(bucket: str, tmp_path: Path) -> None:
    """botocore's "Parameter validation failed" (several lines, with its regexes) at exit 1."""
    url = f"s3://{bucket}/prefix"
    for args in (("images", "list", url), ("images", "push", str(tmp_path), url, "--job", "x")):
        r = sg(*args, env={"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"})
        line = refused(r, "names an invalid bucket")
        assert len(line) < 300 + len(url), line


def test_images_list_of_a_file_url_with_a_host() -> None:
    """``file://relative/x`` was read as the directory /x (exit 1, "no directory /x")."""
    r = sg("images", "list", "file://relative/x")
    assert refused(r) == (
        "spotguard: error: file URL 'file://relative/x' must be file:///absolute/path"
    )


def test_images_push_of_a_bad_job_name(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "f").write_text("x")
    r = sg("images", "push", str(tmp_path / "img"), str(tmp_path), "--job", "../x")
    refused(r, "--job", "invalid job name '../x'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img"]


def test_images_pull_into_an_empty_directory_name(tmp_path: Path) -> None:
    """``images pull URL ''`` unpacked the image into the working directory."""
    store, work = tmp_path / "store", tmp_path / "work"
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "f").write_text("x")
    work.mkdir()
    store.mkdir()
    assert sg("images", "push", str(tmp_path / "img"), str(store), "--job", "x").returncode == 0
    r = sg("images", "pull", f"{store}/x/images/latest", "", cwd=work)
    refused(r, "DEST_DIR", "empty")
    assert os.listdir(work) == []


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--default-store", "ftp://bucket/x", "unsupported store URL 'ftp://bucket/x'"),
        ("--default-store", "s3://", "names no bucket"),
        ("--advertise-url", "controller.internal:9900", "is not an http(s) URL"),
        ("--advertise-url", "http://10.0.0.5:99999", "is not an http(s) URL"),
    ],
)
def test_the_controller_refuses_urls_it_would_hand_out(
    flag: str, value: str, says: str, tmp_path: Path
) -> None:
    """A default store or an advertised URL no agent could use is refused at start (exit 2),
    not met when the first relaunched VM is told where to report or restore from."""
    token = tmp_path / "token"
    token.write_text("t" * 40)
    env = {"SPOTGUARD_CONTROLLER_TOKEN_FILE": str(token)}
    r = sg("controller", "--state-dir", str(tmp_path), "--init-state", flag, value, env=env,
           timeout=30)  # fmt: skip
    refused(r, says)


def test_images_push_of_a_directory_that_does_not_exist(tmp_path: Path) -> None:
    """Bad input like a file in its place (click's exit 2), not a failure of the push (1)."""
    r = sg("images", "push", str(tmp_path / "none"), f"file://{tmp_path / 'store'}", "--job", "a")
    refused(r, "DIRECTORY", "does not exist")
    assert not (tmp_path / "store").exists()
