"""Detection of the driver's custom-storage checkpoint (``cuCheckpointOperationComplete``,
CUDA 13.4's driver API): asked of the driver library itself. Real shared libraries: one built
here with that entry point, one without it, and a name no loader finds."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from spotguard.checkpoint.cuda import CUSTOM_STORAGE_SYMBOL, custom_storage_available


def _library(tmp_path: Path, name: str, symbol: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) to build the test's shared library")
    src = tmp_path / f"{name}.c"
    src.write_text(f"int {symbol}(void *handle) {{ (void)handle; return 0; }}\n")
    lib = tmp_path / f"lib{name}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def test_a_driver_library_with_the_call_has_custom_storage(tmp_path: Path) -> None:
    assert custom_storage_available(str(_library(tmp_path, "cuda13", CUSTOM_STORAGE_SYMBOL)))


def test_a_driver_library_without_it_or_no_library_has_not(tmp_path: Path) -> None:
    assert not custom_storage_available(
        str(_library(tmp_path, "cuda580", "cuCheckpointProcessLock"))
    )
    assert not custom_storage_available(str(tmp_path / "libcuda-missing.so.1"))
