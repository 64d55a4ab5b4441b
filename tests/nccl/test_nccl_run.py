"""``spotguard run``'s NCCL settings as the job sees them (its /proc/PID/environ): the shim
preloaded is tests/nccl/test_nccl_release.py's; ``--nccl restrict`` and a missing shim (the
fallback, said in one line) turn the fast transports off here."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import Built
from sgtest import sg, wait_for
from spotguard.checkpoint import proctree
from spotguard.checkpoint.cuda import NVIDIA_CTL
from spotguard.checkpoint.nccl import CHECKPOINTABLE
from spotguard.checkpoint.ncclctl import ENV_CTL
from spotguard.checkpoint.procfacts import comm, read_environ
from spotguard.groupwire import GROUP_ENV

pytestmark = pytest.mark.criu  # spotguard run needs root

RESTRICTED = {key: value for key, (value, _why) in CHECKPOINTABLE.items()}


def _run(
    state: Path, name: str, *flags: str, config: Path | None = None
) -> tuple[dict[str, str], str]:
    """Start ``sleep`` through ``spotguard run``: its environment and run's stderr."""
    res = sg("run", "--json", "--state-dir", str(state), "--name", name, *flags, "--",
             "sleep", "60", config=config, timeout=60)  # fmt: skip
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    pid = int(json.loads(res.stdout.splitlines()[-1])["pid"])
    try:
        found: list[int] = []

        def sleeping() -> bool:
            found[:] = [p for p in proctree.tree(pid) if comm(p) == "sleep"]
            return bool(found)

        wait_for(sleeping, f"job {name}'s command")
        return read_environ(found[0]), res.stderr
    finally:
        proctree.signal_all(proctree.tree(pid), signal.SIGKILL)


def test_run_restricts_nccl_when_asked_and_when_the_shim_is_missing(
    built: Built, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    env, err = _run(state, "restricted", "--nccl", "restrict", "--nccl-shim", str(built.shim))
    assert {k: env.get(k) for k in RESTRICTED} == RESTRICTED
    assert str(built.shim) not in env.get("LD_PRELOAD", "") and ENV_CTL not in env
    assert "no NCCL shim" not in err

    missing = tmp_path / "none" / "libspotguard_nccl.so"
    env, err = _run(state, "fallback", "--nccl", "release", "--nccl-shim", str(missing))
    assert {k: env.get(k) for k in RESTRICTED} == RESTRICTED
    fallback = [line for line in err.splitlines() if "no NCCL shim" in line]
    assert fallback == [
        f"spotguard run: no NCCL shim at {missing} (scripts/install-nccl-shim): NCCL's fast "
        "transports are turned off for this job (--nccl restrict)"
    ]


@pytest.mark.skipif(Path(NVIDIA_CTL).exists(), reason="this host has an NVIDIA GPU")
def test_run_on_a_host_without_gpus_says_nothing_of_nccl(tmp_path: Path) -> None:
    """On a host with no NVIDIA GPU a job cannot use NCCL: the shim's absence is not news
    there unless ``--nccl``/``--nccl-shim`` were given (the test above); set in the config
    file, it stays unsaid. The job is started as restricted as ever."""
    missing = tmp_path / "none" / "libspotguard_nccl.so"
    config = tmp_path / "spotguard.toml"
    config.write_text(f'[checkpoint]\nnccl_shim = "{missing}"\n')
    env, err = _run(tmp_path / "state", "cpu", config=config)
    assert "NCCL" not in err, err
    assert {k: env.get(k) for k in RESTRICTED} == RESTRICTED


def test_run_names_the_group_and_leaves_the_interface_to_the_job(
    built: Built, tmp_path: Path
) -> None:
    """``--nccl-group`` puts the group in the job's environment and does not pin NCCL or
    gloo to loopback (its ranks must reach the other VMs); a bad name is one line."""
    state = tmp_path / "state"
    env, _ = _run(state, "member", "--nccl-group", "train-7b", "--nccl-shim", str(built.shim))
    assert env.get(GROUP_ENV) == "train-7b"
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in env
    assert env["LD_PRELOAD"].split()[0] == str(built.shim)
    alone, _ = _run(state, "alone", "--nccl-shim", str(built.shim))
    assert alone["NCCL_SOCKET_IFNAME"] == "lo" and GROUP_ENV not in alone

    bad = sg("run", "--state-dir", str(state), "--nccl-group", "../x", "--", "sleep", "1",
             timeout=60)  # fmt: skip
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr
    assert "NCCL group '../x': use 1 to 128 letters" in bad.stderr
