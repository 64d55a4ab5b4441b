"""Files shipped inside the package: the systemd units, the example config, the Grafana
dashboard, the install script, the CRIU installer and the NCCL shim's installer and sources.

The wheel carries them under ``spotguard/_data/`` (``[tool.hatch.build.targets.wheel.
force-include]`` in pyproject.toml maps them from ``packaging/`` and ``scripts/`` — the same
files, not copies). Run from a source tree (``PYTHONPATH=src`` or an editable install) they are
found where they live in the repository.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from spotguard.errors import ConfigError

__all__ = ["UNITS", "data_file"]

#: the systemd units ``spotguard install`` puts in place
UNITS = ("spotguard-agent.service", "spotguard-controller.service", "spotguard-doctor.service")

_REPO = Path(__file__).resolve().parents[2]
#: name under ``_data/`` → where the file lives in the repository
_SOURCES = {
    "systemd": _REPO / "packaging" / "systemd",
    "spotguard.toml.example": _REPO / "packaging" / "spotguard.toml.example",
    "grafana": _REPO / "packaging" / "grafana",
    "install-criu": _REPO / "scripts" / "install-criu",
    "install.sh": _REPO / "packaging" / "install.sh",
    "install-nccl-shim": _REPO / "scripts" / "install-nccl-shim",
    "nccl-shim": _REPO / "packaging" / "nccl-shim",
}


def data_file(name: str) -> Path:
    """Path of a shipped file or directory (``systemd/spotguard-agent.service``, ...)."""
    top, _, rest = name.partition("/")
    if top not in _SOURCES:
        raise ConfigError(f"no packaged file {name!r} (known: {', '.join(sorted(_SOURCES))})")
    shipped = Path(str(files("spotguard").joinpath("_data", name)))
    if shipped.exists():
        return shipped
    source = _SOURCES[top] / rest if rest else _SOURCES[top]
    if source.exists():
        return source
    raise ConfigError(
        f"packaged file {name!r} is missing from this installation ({shipped}); reinstall "
        "spotguard from its wheel"
    )
