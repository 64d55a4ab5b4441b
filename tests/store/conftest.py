"""Fixtures for store tests (shared with tests/image): see store_servers.py."""

from __future__ import annotations

from sgtest import store_servers

_m = store_servers()
gcs_server = _m.gcs_server  # type: ignore[attr-defined]
gcs_bucket = _m.gcs_bucket  # type: ignore[attr-defined]
s3_bucket = _m.s3_bucket  # type: ignore[attr-defined]
store_url = _m.store_url  # type: ignore[attr-defined]
fault_proxy = _m.fault_proxy  # type: ignore[attr-defined]
gcs_fault_proxy = _m.gcs_fault_proxy  # type: ignore[attr-defined]
