"""Fixtures of the web page tests: a real headless Chromium (Debian's ``chromium``, installed by
scripts/install-chromium; ``make test`` runs it first)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_cdp import find_chromium

#: with SPOTGUARD_REQUIRE_CHROMIUM=1 (CI) a missing browser fails the tests instead of skipping
REQUIRE_CHROMIUM = os.environ.get("SPOTGUARD_REQUIRE_CHROMIUM") == "1"


@pytest.fixture(scope="session")
def chromium() -> str:
    """The Chromium executable; skips with the reason when there is none (fails under
    SPOTGUARD_REQUIRE_CHROMIUM=1)."""
    path = find_chromium()
    if path is None:
        msg = (
            "no Chromium to drive the web page: run scripts/install-chromium (Debian's "
            "'chromium' package, needs root and the package index) or set SPOTGUARD_CHROMIUM"
        )
        if REQUIRE_CHROMIUM:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture
def docs_root() -> Iterator[Path]:
    """A fresh ``/tmp/spotguard-docs`` for the docs' screenshots (``SPOTGUARD_UI_SCREENSHOTS``):
    a plain path where the page shows one, never a pytest temp dir. Removed after."""
    root = Path("/tmp/spotguard-docs")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)
