"""Fixtures for store tests (shared with tests/image): see store_servers.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load() -> object:
    name = "spotguard_test_store_servers"
    if name not in sys.modules:
        path = Path(__file__).with_name("store_servers.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


_m = _load()
gcs_server = _m.gcs_server  # type: ignore[attr-defined]
gcs_bucket = _m.gcs_bucket  # type: ignore[attr-defined]
s3_bucket = _m.s3_bucket  # type: ignore[attr-defined]
store_url = _m.store_url  # type: ignore[attr-defined]
fault_proxy = _m.fault_proxy  # type: ignore[attr-defined]
gcs_fault_proxy = _m.gcs_fault_proxy  # type: ignore[attr-defined]
