"""``spotguard install`` and ``spotguard install-criu``: put an installed spotguard in place.

``install`` is the second half of the documented one-liner (``packaging/install.sh`` is the
first: a dedicated virtualenv under ``/opt/spotguard/venv``). In order:

1. link ``/usr/local/bin/spotguard`` to this environment's ``spotguard`` (sudo's PATH has
   /usr/local/bin; a venv's bin does not);
2. the systemd units into ``/etc/systemd/system`` (replaced: they belong to the package);
3. ``/etc/spotguard`` (0700) with ``spotguard.toml.example`` (an existing ``spotguard.toml``
   is never touched) and ``/var/lib/spotguard`` (0700);
4. with systemd running: ``daemon-reload`` and ``enable spotguard-doctor.service`` (the
   agent is enabled once its config exists; the controller where it runs);
5. spotguard's NCCL shim, built against the jobs' nccl.h (``install-nccl-shim``; a host
   without a compiler or nccl.h is told so, and NCCL jobs run with restricted transports);
6. ``spotguard doctor``'s checks, printed with their fixes.

``--root DIR`` installs under DIR instead of ``/`` (for images and tests; no systemctl).

Exit status: 0 installed (doctor's failures are printed as hints, not errors: CRIU may be
installed next); 1 a step failed (one line naming it); 2 bad usage (not root).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click

from spotguard.errors import ConfigError, SpotguardError
from spotguard.packaged import UNITS, data_file

__all__ = ["install", "install_criu", "install_nccl_shim"]


def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _console_script() -> Path:
    """This environment's ``spotguard`` (the venv's bin, next to its python)."""
    exe = Path(sys.executable).parent / "spotguard"
    if not exe.is_file():
        raise SpotguardError(
            f"no spotguard console script next to {sys.executable}: install spotguard into "
            "that environment (pip install spotguard) and run its bin/spotguard install"
        )
    return exe


def _link(target: Path, link: Path, force: bool) -> str:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or not link.exists():
        link.unlink(missing_ok=True)
        link.symlink_to(target)
        return f"linked {link} -> {target}"
    if link.resolve() == target.resolve():
        return f"{link} is already {target}"
    if not force:
        raise SpotguardError(
            f"{link} exists and is not a link to this spotguard: move it away or use --force"
        )
    link.unlink()
    link.symlink_to(target)
    return f"replaced {link} with a link to {target}"


def _files(root: Path) -> list[str]:
    done = []
    units_dir = _under(root, "/etc/systemd/system")
    units_dir.mkdir(parents=True, exist_ok=True)
    for unit in UNITS:
        shutil.copyfile(data_file(f"systemd/{unit}"), units_dir / unit)
        (units_dir / unit).chmod(0o644)
        done.append(f"unit {units_dir / unit}")
    etc = _under(root, "/etc/spotguard")
    etc.mkdir(parents=True, exist_ok=True)
    etc.chmod(0o700)
    example = etc / "spotguard.toml.example"
    shutil.copyfile(data_file("spotguard.toml.example"), example)
    example.chmod(0o600)
    done.append(f"example config {example}")
    if not (etc / "spotguard.toml").exists():
        done.append(f"(write {etc / 'spotguard.toml'} from the example to configure the agent)")
    state = _under(root, "/var/lib/spotguard")
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o700)
    done.append(f"state directory {state}")
    return done


def _systemd() -> list[str]:
    systemctl = shutil.which("systemctl")
    if systemctl is None or not Path("/run/systemd/system").is_dir():
        return ["systemd is not running here: units installed, not loaded"]
    for args in (["daemon-reload"], ["enable", "spotguard-doctor.service"]):
        out = subprocess.run([systemctl, *args], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SpotguardError(f"systemctl {' '.join(args)} failed: {out.stderr.strip()}")
    return ["systemd: daemon reloaded, spotguard-doctor.service enabled"]


def _run_installer(name: str, args: list[str], capture: bool) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return subprocess.run(
        [bash, str(data_file(name)), *args], capture_output=capture, text=True, check=False
    )


def _nccl_shim() -> str:
    """Build the NCCL shim; never fails the install (one line saying what happened)."""
    done = _run_installer("install-nccl-shim", [], capture=True)
    if done.returncode == 0:
        return f"NCCL shim {done.stdout.strip().splitlines()[-1]}"
    why = (done.stderr.strip().splitlines() or ["failed"])[-1].removeprefix("install-nccl-shim: ")
    return f"NCCL shim not built ({why}): NCCL jobs run with restricted transports"


def _doctor() -> None:
    from spotguard.checkpoint.doctor import run_checks

    for c in asyncio.run(run_checks(None)):
        mark = "ok  " if c.ok else ("FAIL" if c.required else "warn")
        click.echo(f"  doctor {mark} {c.name:<20} {c.found}")
        if not c.ok and c.fix:
            click.echo(f"         {'':<25} fix: {c.fix}")


@click.command("install")
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/"),
    show_default=True,
    help="Install under this directory (no systemctl unless it is /).",
)
@click.option("--force", is_flag=True, help="Replace a spotguard in /usr/local/bin not ours.")
@click.option("--doctor/--no-doctor", default=True, show_default=True, help="Run the checks.")
def install(root: Path, force: bool, doctor: bool) -> None:
    """Link spotguard into /usr/local/bin, install the systemd units, the example config and
    the state directory, then run the doctor's checks.

    Example: sudo /opt/spotguard/venv/bin/spotguard install
    """
    system = root.resolve() == Path("/")
    if system and os.geteuid() != 0:
        raise ConfigError("spotguard install writes /usr/local/bin and /etc: run it with sudo")
    try:
        steps = [_link(_console_script(), _under(root, "/usr/local/bin/spotguard"), force)]
        steps += _files(root)
        if system:
            steps += _systemd()
            steps.append(_nccl_shim())
    except OSError as exc:
        raise SpotguardError(f"install failed: {exc}") from exc
    for step in steps:
        click.echo(f"  {step}")
    if doctor:
        _doctor()
    click.echo(
        "installed; next: write /etc/spotguard/spotguard.toml, then "
        "systemctl enable --now spotguard-agent (docs/operations.md#install)"
    )


@click.command(
    "install-criu", context_settings={"ignore_unknown_options": True, "allow_extra_args": True}
)
@click.option("--print-path", is_flag=True, help="Print the installer's path and exit.")
@click.pass_context
def install_criu(ctx: click.Context, print_path: bool) -> None:
    """Install CRIU >= 4.2.1 with the installer shipped in this package (scripts/install-criu).

    It uses a criu >= 4.2.1 on PATH, or unpacks Debian's into /opt/spotguard/criu without
    touching the host's packages; its last line is the path of a working criu.
    """
    script = data_file("install-criu")
    if print_path:
        click.echo(str(script))
        return
    if os.geteuid() != 0:
        raise ConfigError("spotguard install-criu installs under /opt: run it with sudo")
    bash = shutil.which("bash") or "/bin/bash"
    code = subprocess.run([bash, str(script), *ctx.args], check=False).returncode
    if code != 0:
        raise SpotguardError(f"the CRIU installer {script} failed (exit {code}); its log is above")


@click.command(
    "install-nccl-shim",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
)
@click.option("--print-path", is_flag=True, help="Print the installer's path and exit.")
@click.pass_context
def install_nccl_shim(ctx: click.Context, print_path: bool) -> None:
    """Build spotguard's NCCL shim against the nccl.h of the NCCL the jobs load (PyTorch's
    wheel; PYTHON=... names the jobs' interpreter) into /opt/spotguard/nccl-shim, so that
    'spotguard run' keeps NCCL's fast transports (scripts/install-nccl-shim).
    """
    script = data_file("install-nccl-shim")
    if print_path:
        click.echo(str(script))
        return
    if os.geteuid() != 0:
        raise ConfigError("spotguard install-nccl-shim installs under /opt: run it with sudo")
    code = _run_installer("install-nccl-shim", list(ctx.args), capture=False).returncode
    if code != 0:
        raise SpotguardError(f"the NCCL shim installer {script} failed (exit {code}); see above")
