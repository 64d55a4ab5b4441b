"""The fault matrix (issue 14): every case is a test against real processes and real servers.

Fixtures: the real stores and fault proxies of tests/store/store_servers.py, and ``settings``
(``sgtest.criu_settings``: checkpoint settings under the test's tmp_path). Each test here is
one fault case (a parametrised test: one case per parameter set); at the end of the run the
terminal summary counts them — cases run, cases that held, known-open ones (xfail, each with
its reason) — and, when ``SPOTGUARD_FAULTS_REPORT`` names a file, writes the same as JSON
(docs/operations.md, "Fault table", records the figure). The count lives in
tests/sg_faultcount.py, registered by tests/conftest.py: under pytest-xdist only the root
conftest's hooks see every worker's reports.
"""

from __future__ import annotations

from sgtest import criu_settings, store_servers

_m = store_servers()
settings = criu_settings  # the ``settings`` fixture: CRIU-backed checkpoint settings per test
gcs_server = _m.gcs_server  # type: ignore[attr-defined]
gcs_bucket = _m.gcs_bucket  # type: ignore[attr-defined]
s3_bucket = _m.s3_bucket  # type: ignore[attr-defined]
fault_proxy = _m.fault_proxy  # type: ignore[attr-defined]
gcs_fault_proxy = _m.gcs_fault_proxy  # type: ignore[attr-defined]
