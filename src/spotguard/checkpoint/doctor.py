"""``spotguard doctor``: can this host checkpoint and restore jobs? One check per piece,
each with what was found and, when missing, how to fix it; last, when root and CRIU pass,
a self-test parks and unparks a small job with sockets (:mod:`.selftest`)."""

from __future__ import annotations

import asyncio
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

from spotguard.errors import PreflightError

from . import cuda, placing, stagefault
from .criu import MIN_VERSION_TEXT, PLUGIN_NAME, Criu, version_ok
from .criufind import has_external_pages, has_page_workers, has_parallel_drain
from .selftest import run_selftest


@dataclass(frozen=True)
class Check:
    """One finding: ``ok`` False means checkpoints will not work (or not for GPU jobs)."""

    name: str
    ok: bool
    found: str
    fix: str = ""
    required: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def _criu_checks(path: str | None) -> list[Check]:
    try:
        criu = Criu(path)
    except PreflightError as exc:
        return [
            Check("criu", False, str(exc), "run: sudo spotguard install-criu (installs CRIU 4.2.1)")
        ]
    try:
        version = await criu.version()
    except PreflightError as exc:
        return [Check("criu", False, str(exc), "reinstall with: sudo spotguard install-criu")]
    new_enough = version_ok(version)
    out = [
        Check(
            "criu",
            new_enough,
            f"{criu.path} version {version}",
            ""
            if new_enough
            else f"CRIU >= {MIN_VERSION_TEXT} needed: run: sudo spotguard install-criu",
        ),
        Check(
            "criu plugin",
            criu.plugin_dir is not None,
            str(criu.plugin_dir / f"{PLUGIN_NAME}.so") if criu.plugin_dir else "not installed",
            ""
            if criu.plugin_dir
            else "run: sudo spotguard install-criu on a host with a C compiler: without the "
            "plugin, jobs with forked DataLoader workers (leftover /dev/nvidia* references) "
            "cannot be dumped",
            required=False,
        ),
    ]
    out.append(await asyncio.to_thread(_patches_check, criu.path))
    passed, text = await criu.check()
    last = text.strip().splitlines()[-1] if text.strip() else ""
    out.append(
        Check(
            "criu check",
            passed,
            last or "(no output)",
            "" if passed else "run 'criu check' as root; see its output for the kernel feature",
        )
    )
    return out


#: what each of spotguard's CRIU patches gives, by how its ``--help`` shows it
#: (packaging/criu-patches, docs/ARCHITECTURE.md "CRIU patches")
_PATCHES = (
    ("--page-workers (a job's processes dumped and restored at once)", has_page_workers),
    ("--external-pages (GPU memory copied beside CRIU)", has_external_pages),
    ("several tasks' pages drained at once", has_parallel_drain),
)


def _patches_check(path: str) -> Check:
    """Which of spotguard's patches the CRIU at ``path`` has. Not required: a CRIU without
    them dumps and restores the same images, one process after another."""
    lacks = [name for name, has in _PATCHES if not has(path)]
    return Check(
        "criu patches",
        not lacks,
        "spotguard's patches built in" if not lacks else f"{path} lacks: {'; '.join(lacks)}",
        ""
        if not lacks
        else "run: sudo spotguard install-criu (it rebuilds CRIU with this release's patches: "
        "without them checkpoints work, slower for jobs of several large processes or GPUs)",
        required=False,
    )


async def _selftest_check(criu_path: str | None) -> Check:
    result = await run_selftest(Criu(criu_path))
    return Check("self-test", result.ok, result.found, result.fix)


async def run_checks(criu_path: str | None = None, *, self_test: bool = True) -> list[Check]:
    """Every check, in the order a person would fix them; the self-test only when the
    checks it depends on (root, CRIU) passed."""
    checks = [
        Check(
            "root",
            os.geteuid() == 0,
            f"uid {os.geteuid()}",
            "run as root (CRIU and PID namespaces need it)",
        ),
        Check(
            "kernel",
            platform.machine() == "x86_64",
            f"{platform.system()} {platform.release()} {platform.machine()}",
            "the NVIDIA checkpoint API is x86-64 only",
        ),
    ]
    checks += await _criu_checks(criu_path)
    if self_test and all(c.ok for c in checks if c.required):
        checks.append(await _selftest_check(criu_path))
    inv = cuda.inventory()
    if inv.count:
        checks.append(
            Check("gpu", True, f"{inv.count} x {inv.model}, driver {inv.driver}", required=False)
        )
        major = inv.driver_major or 0
        checks.append(
            Check(
                "driver",
                major >= 570,
                f"driver {inv.driver}",
                "" if major >= 570 else "install NVIDIA driver r570 or newer",
                required=False,
            )
        )
        api = cuda.driver_available()
        checks.append(
            Check(
                "gpu checkpoint api",
                api,
                "cuCheckpointProcess* present" if api else "libcuda lacks the checkpoint API",
                ""
                if api
                else "install NVIDIA driver r570+ (libcuda.so.1 with cuCheckpointProcessLock)",
                required=False,
            )
        )
        custom = cuda.custom_storage_available()
        checks.append(
            Check(
                "gpu custom storage",
                True,  # information: its absence is the driver branch, nothing to fix
                "present in the driver (spotguard does not use it yet: docs/limits.md)"
                if custom
                else f"not in driver {inv.driver}: the driver stages GPU memory in the "
                "process's host memory, and spotguard copies it beside CRIU",
                required=False,
            )
        )
        ready, found, fix = stagefault.readiness()
        checks.append(Check("gpu staging prefault", ready, found, fix, required=False))
        ready, found, fix = await asyncio.to_thread(placing.readiness)
        checks.append(Check("gpu restore overlap", ready, found, fix, required=False))
    else:
        checks.append(
            Check(
                "gpu",
                False,
                "no NVIDIA GPU or driver (NVML not available)",
                "CPU jobs work; for GPU jobs install the NVIDIA driver r570+ and nvidia-ml-py",
                required=False,
            )
        )
    return checks
