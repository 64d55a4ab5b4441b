"""Issue 17.1: the wheel installs what a VM needs. It carries the systemd units, the example
config, the dashboard and the CRIU installer (built from the repository's files, not copies),
``py.typed`` and PyPI metadata; ``spotguard install`` links the CLI where sudo finds it and
puts the units and directories in place; the doctor's fix hints name what the wheel has."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from ops_helpers import ROOT, clean_env

from spotguard.packaged import UNITS

SHIPPED = {
    **{f"spotguard/_data/systemd/{u}": ROOT / "packaging" / "systemd" / u for u in UNITS},
    "spotguard/_data/spotguard.toml.example": ROOT / "packaging" / "spotguard.toml.example",
    "spotguard/_data/grafana/spotguard-dashboard.json": ROOT
    / "packaging"
    / "grafana"
    / "spotguard-dashboard.json",
    "spotguard/_data/install.sh": ROOT / "packaging" / "install.sh",
    "spotguard/_data/install-criu": ROOT / "scripts" / "install-criu",
    "spotguard/_data/spotguard_nvleftover.c": ROOT
    / "packaging"
    / "criu-plugin"
    / "spotguard_nvleftover.c",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from this tree as the README says (pip's build isolation)."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (whl,) = out.glob("spotguard-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv holding the wheel; its dependencies come from the test
    environment's site-packages (a path entry, so the wheel's spotguard is the one found)."""
    where = tmp_path_factory.mktemp("venv") / "venv"
    venv.create(where, with_pip=False)
    site = next(where.glob("lib/python3*/site-packages"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    deps = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "zz-test-deps.pth").write_text(deps + "\n")
    script = where / "bin" / "spotguard"
    script.write_text(
        f"#!{where}/bin/python\nimport sys\nfrom spotguard.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)
    return where


def test_wheel_ships_the_files_a_vm_needs_and_pypi_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name, source in SHIPPED.items():
            assert name in names, f"{name} is not in the wheel"
            assert z.read(name) == source.read_bytes(), f"{name} differs from {source}"
        assert "spotguard/py.typed" in names
        meta = email.message_from_bytes(
            z.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
        )
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    classifiers = meta.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
    assert meta["Requires-Python"] == ">=3.11"
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"aws", "gcp", "gpu"} <= extras


def test_install_links_the_cli_and_puts_units_config_and_state_in_place(
    wheel_env: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    exe = wheel_env / "bin" / "spotguard"
    r = subprocess.run(
        [str(exe), "install", "--root", str(root), "--no-doctor"],
        capture_output=True,
        text=True,
        env=clean_env(PYTHONPATH=""),
    )
    assert r.returncode == 0, r.stderr
    link = root / "usr" / "local" / "bin" / "spotguard"
    assert link.is_symlink() and link.resolve() == exe.resolve()
    version = subprocess.run([str(link), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "0.1.0" in version.stdout
    for unit in UNITS:
        installed = root / "etc" / "systemd" / "system" / unit
        assert installed.read_bytes() == (ROOT / "packaging" / "systemd" / unit).read_bytes()
        assert "ExecStart=/usr/local/bin/spotguard" in installed.read_text()
    etc = root / "etc" / "spotguard"
    assert oct(etc.stat().st_mode & 0o777) == "0o700"
    assert (etc / "spotguard.toml.example").is_file()
    assert oct((root / "var" / "lib" / "spotguard").stat().st_mode & 0o777) == "0o700"
    # again: idempotent, and a config written meanwhile is never touched
    (etc / "spotguard.toml").write_text("[agent]\n")
    again = subprocess.run(
        [str(exe), "install", "--root", str(root), "--no-doctor"],
        capture_output=True,
        text=True,
        env=clean_env(PYTHONPATH=""),
    )
    assert again.returncode == 0, again.stderr
    assert (etc / "spotguard.toml").read_text() == "[agent]\n"


def test_install_criu_runs_the_installer_the_wheel_ships(wheel_env: Path) -> None:
    exe = wheel_env / "bin" / "spotguard"
    env = clean_env(PYTHONPATH="")
    r = subprocess.run(
        [str(exe), "install-criu", "--print-path"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert str(path).startswith(str(wheel_env)), "the packaged copy, not the repository's"
    assert path.read_bytes() == (ROOT / "scripts" / "install-criu").read_bytes()
    if os.geteuid() == 0 and Path("/opt/spotguard/criu/bin/criu").exists():
        # CRIU is installed here already: the installer finds it and says where (idempotent).
        done = subprocess.run([str(exe), "install-criu"], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1].endswith("criu")


def test_doctor_hints_at_the_installer_the_wheel_has(tmp_path: Path) -> None:
    missing = tmp_path / "no-criu"
    r = subprocess.run(
        ["spotguard", "doctor", "--criu", str(missing)],
        capture_output=True,
        text=True,
        env=clean_env(),
    )
    assert r.returncode == 1
    assert "fix: run: sudo spotguard install-criu" in r.stdout
    assert "scripts/install-criu" not in r.stdout


def test_install_sh_without_an_argument_says_spotguard_is_not_on_the_package_index() -> None:
    """``sh packaging/install.sh`` with nothing to install: exit 2 and a usage line saying
    why no default (the package index has no spotguard) and how to build a wheel."""
    out = subprocess.run(
        ["sh", str(ROOT / "packaging" / "install.sh")], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2, out
    assert out.stdout == "", out.stdout
    assert "spotguard is not on the package index" in out.stderr, out.stderr
    assert "pip wheel" in out.stderr and "Traceback" not in out.stderr, out.stderr
