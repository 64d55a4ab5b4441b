"""Shared fixtures. Every test talks to real processes and real local servers. Helpers that
several test areas use (free_port, wait_for, the spotguard CLI runner, the store servers) live
in tests/sgtest.py; helpers of one area stay in its *_helpers.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import pytest

import sg_leftovers as leftovers
from sg_faultcount import pytest_runtest_logreport as pytest_runtest_logreport
from sg_faultcount import pytest_terminal_summary as pytest_terminal_summary

REQUIRE_CRIU = os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1"
#: set by scripts/test-passes: this run is one of ``make test``'s passes, which may select
#: nothing (a path with no serial test); the script fails a run where no pass ran a test
IN_PASSES = os.environ.get("SPOTGUARD_TEST_PASS") == "1"
MIN_TESTS = 1
#: ``SPOTGUARD_*`` variables that steer the test harness itself (which CRIU, how strict, GPU
#: test sizes, reports), not spotguard's settings: the only ones kept from the caller.
HARNESS_VARS = frozenset(
    {
        "SPOTGUARD_REQUIRE_CRIU",
        "SPOTGUARD_CRIU",
        "SPOTGUARD_CRIU_DEBS",
        "SPOTGUARD_PODMAN_DEBS",
        "SPOTGUARD_CONTAINERD_DEBS",
        "SPOTGUARD_TEST_TORCH_PYTHON",
        "SPOTGUARD_PARK_TEST_MB",
        "SPOTGUARD_FAULTS_REPORT",
        "SPOTGUARD_GPU_PYTEST",
        "SPOTGUARD_WHEELS",
        "SPOTGUARD_CHROMIUM",
        "SPOTGUARD_REQUIRE_CHROMIUM",
        "SPOTGUARD_UI_SCREENSHOTS",
        "SPOTGUARD_TEST_PASS",
    }
)


def isolate_environment(environ: MutableMapping[str, str]) -> list[str]:
    """Remove the caller's spotguard settings (``SPOTGUARD_STATE_DIR``, ``_STORE``, ``_CONFIG``,
    ...) from ``environ``: a test sets what it needs, and an operator's exported variables must
    neither fail tests nor point them at a real state dir. Returns the names removed."""
    dropped = sorted(k for k in environ if k.startswith("SPOTGUARD_") and k not in HARNESS_VARS)
    for key in dropped:
        del environ[key]
    return dropped


# At import, before any test module (or spotguard) reads the environment.
_DROPPED = isolate_environment(os.environ)
# The agents the tests start leave the host's transparent huge page mode as it is (a host
# setting that the agent sets to 'always' by default; tests of it use their own sysfs tree).
os.environ["SPOTGUARD_TRANSPARENT_HUGEPAGES"] = "keep"


def pytest_configure(config: pytest.Config) -> None:
    """Tests run the console scripts installed beside this interpreter (``spotguard``,
    ``checkov``, ``shellcheck``), whether or not the virtualenv is activated. Every process the
    tests start inherits :data:`leftovers.MARK` (checked at the end of the session)."""
    bindir = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + path
    if getattr(config, "workerinput", None) is None:
        # the session's mark; an xdist worker keeps the one it inherited from the controller,
        # which checks for leftovers once for every worker's processes
        leftovers.mark_session(os.environ)


#: Test areas whose files share host-wide state beyond one test (runtime daemons' roots and
#: wrappers under /run/spotguard, one container image store): under pytest-xdist each area
#: runs on one worker, its files one after the other.
SERIAL_AREAS = ("container",)
#: Areas that change the host's mount table while they run (container runtimes mount
#: overlays, shm and network namespaces): a ``spotguard run`` job started meanwhile copies
#: those mounts into its own namespace, and CRIU failed on them once they were gone
#: ("doesn't have a proper root mount", "Can't stat mountpoint …/userdata/shm"). They are
#: marked ``serial``: ``make test`` runs them alone, after the parallel pass.
MOUNTING_AREAS = ("container",)

#: Files that run ``spotguard doctor``'s self-test, whose tests check that no self-test
#: directory or process is left on the host: one worker runs them one after the other.
SELFTEST_FILES = frozenset(
    {
        "checkpoint/test_realjobs_doctor.py",
        "checkpoint/test_checkpoint_preflight_cli.py",
        "ops/test_ops_cli_output.py",
    }
)

#: Files that need no CRIU but start whole systems (terraform and checkov, a deploy in
#: namespaces, moto or fake-gcs fleets, controllers and agents end to end, Chromium): marked
#: ``slow``, which ``make unit`` (the fast tier, under two minutes on the CI machine) leaves
#: out; ``make test`` runs them. Measured with ``--durations``: each takes 5-60 s.
SLOW_FILES = frozenset(
    {
        "agent/test_agent_discovery.py",
        "controller/test_controller_aws.py",
        "controller/test_controller_local.py",
        "controller/test_controller_park.py",
        "controller/test_controller_recovery.py",
        "controller/test_controller_tls.py",
        "faults/test_faults_controller.py",
        "faults/test_faults_image.py",
        "fleet/test_fleet_sqs.py",
        "image/test_image_faults.py",
        "image/test_image_trust.py",
        "infra/test_infra_deploy_host.py",
        "infra/test_infra_job_keys.py",
        "infra/test_infra_keys.py",
        "infra/test_infra_terraform.py",
        "ops/test_ops_controller_cli.py",
        "ops/test_ops_images_cli.py",
        "ops/test_ops_progress.py",
        "providers/test_providers_aws_template.py",
        "providers/test_providers_gcp.py",
        "security/test_agent_controller.py",
        "test_isolation.py",
    }
)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that needs CRIU (the ``criu_bin`` fixture, directly or through another fixture)
    is marked ``criu``: ``make unit`` (``-m "not criu and not gpu"``) leaves it out."""
    for item in items:
        if "criu_bin" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.criu)
        # pytest-xdist (make test / make unit run it with --dist loadgroup): a file's tests
        # stay on one worker (its module and session fixtures are made once), and a
        # SERIAL_AREAS area's files all on one
        rel = Path(str(item.path)).relative_to(Path(__file__).parent)
        if rel.as_posix() in SLOW_FILES or rel.parts[0] == "ui":
            item.add_marker(pytest.mark.slow)
        if rel.parts[0] in MOUNTING_AREAS:
            item.add_marker(pytest.mark.serial)
        group = rel.parts[0] if rel.parts[0] in SERIAL_AREAS else str(rel)
        group = "selftest" if rel.as_posix() in SELFTEST_FILES else group
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_report_header(config: pytest.Config) -> str | None:
    if _DROPPED:
        return "cleared from the environment: " + ", ".join(_DROPPED)
    return None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process started by the tests outlived them (it is killed too)."""
    if getattr(session.config, "workerinput", None) is not None:
        return  # an xdist worker: the controller process checks once
    left = leftovers.find(os.environ)
    if not left:
        return
    lines = leftovers.kill(left)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    msg = f"{len(left)} process(es) started by the tests were still running (killed):"
    if reporter is not None:
        reporter.write_sep("=", "leftover processes", red=True)
        reporter.write_line(msg)
        for line in lines:
            reporter.write_line("  " + line)
    else:
        print(msg, *lines, sep="\n  ", file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_finish(session: pytest.Session) -> None:
    """Never let "nothing collected" pass: an empty selection is a failure. Inside
    ``scripts/test-passes`` pytest's own exit status 5 says so instead, and the script fails
    the run when neither pass ran a test."""
    if len(session.items) < MIN_TESTS and not session.config.option.collectonly and not IN_PASSES:
        raise pytest.UsageError("no tests collected: refusing to report success")


def find_criu() -> str | None:
    """A CRIU new enough for spotguard (the same minimum as spotguard.checkpoint.criu), as
    scripts/install-criu installs it."""
    from spotguard.checkpoint.criu import version_ok

    for cand in (
        os.environ.get("SPOTGUARD_CRIU"),
        "/opt/spotguard/criu/bin/criu",
        shutil.which("criu"),
    ):
        if cand and os.access(cand, os.X_OK):
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            version = re.search(r"^Version:\s*(\S+)", out, re.MULTILINE)
            if version_ok(version.group(1) if version else None):
                return cand
    return None


@pytest.fixture(scope="session")
def criu_bin() -> str:
    """Path of CRIU; skips (or fails in CI, where SPOTGUARD_REQUIRE_CRIU=1) when absent."""
    path = find_criu()
    if path is None or os.geteuid() != 0:
        msg = "needs root and CRIU >= 4.2.1 (run scripts/install-criu)"
        if REQUIRE_CRIU:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real moto server (S3, EC2, SQS, EventBridge, DynamoDB) on a free loopback port.

    Yields its endpoint URL. Tests point boto3 at it with ``endpoint_url`` or the standard
    ``AWS_ENDPOINT_URL`` variable; credentials are dummies set by :func:`aws_env`.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Environment that sends every boto3 client to the moto server."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return moto_server
