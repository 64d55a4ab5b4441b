"""Finding CRIU and what it can do: the binary to run (>= 4.2.1), its version, spotguard's
plugin beside it, whether it has ``--page-workers`` (spotguard's patches), and the useful tail
of its log. :mod:`.criu` runs it; these are apart so that the driver stays one concern.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

from spotguard.errors import PreflightError

log = logging.getLogger("spotguard.checkpoint.criu")

INSTALLED = "/opt/spotguard/criu/bin/criu"
#: 4.1.1 cannot dump inet sockets on kernels >= 6.16; scripts/install-criu installs >= this
MIN_VERSION = (4, 2, 1)
MIN_VERSION_TEXT = ".".join(map(str, MIN_VERSION))
PLUGIN_NAME = "spotguard_nvleftover"
#: CRIU's environment variable the plugin reads: ``:``-separated device path prefixes
LEFTOVER_DEVICES_ENV = "SPOTGUARD_CRIU_LEFTOVER_DEVICES"
DEFAULT_LEFTOVER_DEVICES = "/dev/nvidia"
HARMLESS = ("RLIMIT_NOFILE", "kdat", "Unable to get $HOME")
#: environment default for :class:`Criu`'s ``page_workers`` (0 or 1: off)
PAGE_WORKERS_ENV = "SPOTGUARD_CRIU_PAGE_WORKERS"
PAGE_WORKERS_FLAG = "--page-workers"
#: fs.pipe-max-size a dump with page workers raises first: the patch grows a task's page
#: pipes up to it (64 MiB at most); at the kernel's default 1 MiB a CUDA rank's ~11 GB of
#: private mappings needs more pipes than CRIU may open, and is written in chunks, serially
PAGE_PIPE_MAX = 64 << 20
EXTERNAL_PAGES_FLAG = "--external-pages"
#: how ``criu --help`` describes ``--page-workers`` where the parasites of several tasks drain
#: their pages at once (patch 0006); before it, each task's drain held up the next task
PARALLEL_DRAIN_HELP = "drain and write the pages of up to N tasks"
#: (realpath, mtime) -> that criu binary's --help
_HELP_PROBED: dict[tuple[str, float], str] = {}
_TOLD: set[str] = set()


def version_of(path: str) -> str | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"Version:\s*(\S+)", out)
    return m.group(1) if m else None


def _help_text(path: str) -> str | None:
    """``criu --help`` of the binary at ``path``, probed once per binary (a reinstalled one is
    probed again); None if it is not there."""
    real = os.path.realpath(path)
    try:
        key = (real, os.stat(real).st_mtime)
    except OSError:
        return None
    if key not in _HELP_PROBED:
        try:
            out = subprocess.run(
                [path, "--help"], capture_output=True, text=True, timeout=10, check=False
            )
            _HELP_PROBED[key] = out.stdout + out.stderr
        except (OSError, subprocess.SubprocessError):
            _HELP_PROBED[key] = ""
    return _HELP_PROBED[key]


def has_page_workers(path: str) -> bool:
    """Whether the criu at ``path`` has ``--page-workers`` (its ``--help`` lists it)."""
    text = _help_text(path)
    if text is None:
        return False
    if PAGE_WORKERS_FLAG not in text and path not in _TOLD:
        _TOLD.add(path)
        log.info(
            "%s has no %s: processes are dumped and restored one after another "
            "(scripts/install-criu builds the patched criu)",
            path,
            PAGE_WORKERS_FLAG,
        )
    return PAGE_WORKERS_FLAG in text


def has_external_pages(path: str) -> bool:
    """Whether the criu at ``path`` has ``--external-pages`` (spotguard's patch 0004: the
    GPU memory the driver staged is then moved by spotguard, :mod:`.gpupages`)."""
    return EXTERNAL_PAGES_FLAG in (_help_text(path) or "")


def has_parallel_drain(path: str) -> bool:
    """Whether the criu at ``path`` drains several tasks' pages at once under
    ``--page-workers`` (spotguard's patch 0006; its ``--help`` says so). Only tests and
    benchmarks ask: the option and its use are the same either way."""
    text = " ".join((_help_text(path) or "").split())  # the help text wraps lines
    return PARALLEL_DRAIN_HELP in text


def default_page_workers() -> int:
    """``SPOTGUARD_CRIU_PAGE_WORKERS`` if set (a bad value is a clear error), else the CPUs."""
    raw = os.environ.get(PAGE_WORKERS_ENV, "").strip()
    if not raw:
        return os.cpu_count() or 1
    if not raw.isdigit() or int(raw) > 1024:
        raise PreflightError(f"{PAGE_WORKERS_ENV}={raw!r}: expected a number of threads, 0-1024")
    return int(raw)


def parse_version(version: str | None) -> tuple[int, ...]:
    """``"4.2.1"`` -> ``(4, 2, 1)``; anything unparsable -> ``()`` (older than every version)."""
    parts: list[int] = []
    for piece in (version or "").split("-")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def version_ok(version: str | None) -> bool:
    """True if ``version`` is at least :data:`MIN_VERSION` (what spotguard needs)."""
    return parse_version(version) >= MIN_VERSION


def find_criu(explicit: str | None = None) -> str:
    """The CRIU to run: ``explicit`` (setting ``criu`` / SPOTGUARD_CRIU), else ``criu`` on
    PATH if >= 4.2.1, else the one scripts/install-criu installs (if >= 4.2.1)."""
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise PreflightError(f"criu {explicit!r} is not an executable (setting criu)")
        return explicit
    seen: list[str] = []
    for cand in (shutil.which("criu"), INSTALLED):
        if cand and os.access(cand, os.X_OK):
            version = version_of(cand)
            if version_ok(version):
                return cand
            seen.append(f"{cand} is {version or 'of unknown version'}")
    found = f" ({'; '.join(seen)})" if seen else ""
    raise PreflightError(
        f"no CRIU >= {MIN_VERSION_TEXT} found{found}: run: sudo spotguard install-criu "
        "(or set SPOTGUARD_CRIU)"
    )


def find_plugin_dir(criu_path: str) -> Path | None:
    """The plugin directory scripts/install-criu fills next to ``criu_path`` (symlinks such
    as /usr/local/sbin/criu followed), if it holds spotguard's plugin."""
    for path in (Path(criu_path), Path(os.path.realpath(criu_path))):
        plugins = path.parent.parent / "lib" / "criu" / "plugins"
        if (plugins / f"{PLUGIN_NAME}.so").is_file():
            return plugins
    return None


def log_tail(path: Path, lines: int = 25) -> str:
    """The last useful lines of a CRIU log: error lines first, harmless noise dropped."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    useful = [ln for ln in text if not any(h in ln for h in HARMLESS)]
    errors = [ln for ln in useful if "Error" in ln or "error" in ln]
    tail = useful[-lines:]
    head = [ln for ln in errors[-8:] if ln not in tail]
    return "\n".join([*head, *tail])
