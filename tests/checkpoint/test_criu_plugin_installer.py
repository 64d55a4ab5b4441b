"""scripts/install-criu: the CRIU >= 4.2.1 gate, replacing an older prefix from carried .debs,
the library closure check and building the plugin (or saying why not)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spotguard.checkpoint.criu import MIN_VERSION_TEXT, PLUGIN_NAME, version_ok

REPO = Path(__file__).resolve().parents[2]
INSTALLER = REPO / "scripts" / "install-criu"
REQUIRE = os.environ.get("SPOTGUARD_REQUIRE_CRIU") == "1"


def _need(msg: str) -> None:
    if REQUIRE:
        pytest.fail(msg)
    pytest.skip(msg)


def fake_criu(path: Path, version: str, *, check_ok: bool = True) -> Path:
    """A stand-in `criu` that reports ``version`` (and passes or fails `criu check`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && {{ echo "Version: {version}"; exit 0; }}\n'
        f'[ "$1" = check ] && {{ echo "Looks good."; exit {0 if check_ok else 1}; }}\n'
        "exit 2\n"
    )
    path.chmod(0o755)
    return path


def fake_deb(folder: Path, package: str, version: str) -> Path:
    """A real .deb (dpkg-deb -b) named like Debian's, holding one file."""
    root = folder / f"build-{package}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "usr" / "sbin").mkdir(parents=True)
    (root / "usr" / "sbin" / package).write_text("not a program\n")
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: amd64\n"
        "Maintainer: spotguard tests <tests@localhost>\nDescription: stand-in\n"
    )
    deb = folder / f"{package}_{version}_amd64.deb"
    subprocess.run(["dpkg-deb", "-b", str(root), str(deb)], check=True, capture_output=True)
    shutil.rmtree(root)
    return deb


def run_installer(tmp_path: Path, prefix: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The installer with a clean environment: no criu on PATH but ``tmp_path/bin``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    base = {
        "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(tmp_path),
        "SPOTGUARD_CRIU_PREFIX": str(prefix),
    }
    return subprocess.run(
        ["bash", str(INSTALLER)], env={**base, **env}, capture_output=True, text=True, timeout=300
    )


@pytest.fixture
def carried_debs(criu_bin: str) -> Path:
    """The .debs the installed prefix keeps for offline hosts."""
    debs = Path(os.path.realpath(criu_bin)).parents[1] / "debs"
    if not any(debs.glob("criu_*.deb")):
        _need(f"no carried .debs in {debs} (run scripts/install-criu)")
    return debs


@pytest.fixture
def plugin_header(criu_bin: str) -> Path:
    header = Path(os.path.realpath(criu_bin)).parents[1] / "usr/include/criu/criu-plugin.h"
    if not header.is_file():
        _need(f"no {header} (scripts/install-criu unpacks libcriu-dev)")
    return header


def test_the_python_side_and_the_installer_agree_on_the_minimum() -> None:
    assert f"MIN_VERSION={MIN_VERSION_TEXT}\n" in INSTALLER.read_text()
    assert MIN_VERSION_TEXT == "4.2.1"
    assert version_ok("4.2.1") and version_ok("4.3") and version_ok("5.0.0-rc1")
    assert not version_ok("4.1.1") and not version_ok("4.2") and not version_ok(None)


def test_debs_older_than_the_minimum_are_refused(tmp_path: Path) -> None:
    fake_criu(tmp_path / "bin" / "criu", "4.1.1")
    debs = tmp_path / "debs"
    debs.mkdir()
    fake_deb(debs, "criu", "4.1.1-1")
    prefix = tmp_path / "prefix"
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU_DEBS=str(debs))
    assert out.returncode == 1
    assert f"not using {tmp_path}/bin/criu (criu 4.1.1; need >= 4.2.1" in out.stderr
    assert "is criu 4.1.1-1; spotguard needs >= 4.2.1" in out.stderr
    assert not prefix.exists()


def test_a_new_enough_criu_is_kept_and_the_plugin_is_built_beside_it(
    tmp_path: Path, plugin_header: Path
) -> None:
    criu = fake_criu(tmp_path / "elsewhere" / "criu", "4.2.1")
    prefix = tmp_path / "prefix"
    (prefix / "usr/include/criu").mkdir(parents=True)
    shutil.copy(plugin_header, prefix / "usr/include/criu/")
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU=str(criu))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == str(criu)
    built = prefix / "lib/criu/plugins" / f"{PLUGIN_NAME}.so"
    assert built.is_file(), out.stderr
    symbols = subprocess.run(["nm", "-D", str(built)], capture_output=True, text=True).stdout
    assert " D CR_PLUGIN_DESC" in symbols
    again = run_installer(tmp_path, prefix, SPOTGUARD_CRIU=str(criu))
    assert "is up to date" in again.stderr


def test_a_prefix_without_the_header_gets_it_from_the_carried_debs(
    tmp_path: Path, carried_debs: Path
) -> None:
    """A CRIU installed earlier from .debs that lacked libcriu-dev is kept, and the plugin is
    built once the .debs given now carry the header (seen on an offline GPU host)."""
    criu = fake_criu(tmp_path / "elsewhere" / "criu", "4.2.1")
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU=str(criu))
    assert "no criu-plugin.h" in out.stderr
    out = run_installer(
        tmp_path, prefix, SPOTGUARD_CRIU=str(criu), SPOTGUARD_CRIU_DEBS=str(carried_debs)
    )
    assert out.returncode == 0, out.stderr
    assert (prefix / "lib/criu/plugins" / f"{PLUGIN_NAME}.so").is_file(), out.stderr


def test_without_a_compiler_it_says_so_and_criu_still_installs(
    tmp_path: Path, plugin_header: Path
) -> None:
    criu = fake_criu(tmp_path / "elsewhere" / "criu", "4.2.1")
    prefix = tmp_path / "prefix"
    (prefix / "usr/include/criu").mkdir(parents=True)
    shutil.copy(plugin_header, prefix / "usr/include/criu/")
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU=str(criu), CC="no-such-cc")
    assert out.returncode == 0
    assert "plugin: no C compiler (no-such-cc); not built" in out.stderr
    assert not (prefix / "lib/criu/plugins" / f"{PLUGIN_NAME}.so").exists()


def test_an_older_prefix_is_replaced_from_carried_debs(
    tmp_path: Path, criu_bin: str, carried_debs: Path
) -> None:
    prefix = tmp_path / "prefix"
    fake_criu(prefix / "bin" / "criu", "4.1.1")
    (prefix / "old-marker").write_text("4.1.1 was here")
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU_DEBS=str(carried_debs))
    assert out.returncode == 0, out.stderr
    criu = prefix / "bin" / "criu"
    assert out.stdout.splitlines()[-1] == str(criu)
    version = subprocess.run([str(criu), "--version"], capture_output=True, text=True).stdout
    assert version_ok(version.split("Version:")[1].split()[0])
    assert not (prefix / "old-marker").exists(), "the old prefix is replaced as a whole"
    kept = {p.name.split("_")[0] for p in (prefix / "debs").glob("*.deb")}
    assert {"criu", "libcriu-dev", "libc6", "libnet9", "libcompel1"} <= kept
    if shutil.which("cc"):
        assert (prefix / "lib/criu/plugins" / f"{PLUGIN_NAME}.so").is_file(), out.stderr


def test_a_library_missing_from_the_debs_is_named_and_the_old_prefix_kept(
    tmp_path: Path, carried_debs: Path
) -> None:
    debs = tmp_path / "debs"
    debs.mkdir()
    for deb in carried_debs.glob("*.deb"):
        if not deb.name.startswith("libjansson4_"):
            shutil.copy(deb, debs)
    prefix = tmp_path / "prefix"
    fake_criu(prefix / "bin" / "criu", "4.1.1")
    out = run_installer(tmp_path, prefix, SPOTGUARD_CRIU_DEBS=str(debs))
    assert out.returncode == 1
    # not found at all, or found only among the host's own libraries: both are refused
    named = [ln for ln in out.stderr.splitlines() if "libjansson.so.4" in ln]
    assert named and all("not found" in ln or "outside the prefix" in ln for ln in named)
    assert "some libraries do not resolve inside" in out.stderr
    assert (
        "4.1.1"
        in subprocess.run(
            [str(prefix / "bin" / "criu"), "--version"], capture_output=True, text=True
        ).stdout
    )
    assert not Path(f"{prefix}.new").exists()
