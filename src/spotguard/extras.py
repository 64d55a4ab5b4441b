"""Optional extras: which features need which ``spotguard[extra]`` and a clear error without it.

spotguard's core imports no cloud SDK. A store or provider of a cloud needs that cloud's
extra (``pip install 'spotguard[aws]'``); without it, the first use would end in a bare
``No module named 'botocore'`` deep in a thread. :func:`require` checks up front, by import
spec only (nothing is imported), and raises :class:`~spotguard.errors.MissingExtra` naming
the extra and the exact command that installs it into *this* interpreter's environment.

=========  ========================================  ==========================================
extra      modules                                    needed by
=========  ========================================  ==========================================
``aws``    ``boto3``, ``botocore``                    ``s3://`` stores, provider ``aws``, fleet
``gcp``    ``google.cloud.storage``, ``compute_v1``   ``gs://`` stores, provider ``gcp``
``gpu``    ``pynvml``                                 GPU inventory (CPU jobs work without it)
=========  ========================================  ==========================================
"""

from __future__ import annotations

import importlib.util
import sys
from urllib.parse import urlparse

from spotguard.errors import MissingExtra

__all__ = ["EXTRAS", "install_hint", "missing", "require", "require_for_store"]

#: extra → the modules it provides (checked by import spec, never imported here)
EXTRAS: dict[str, tuple[str, ...]] = {
    "aws": ("boto3", "botocore"),
    "gcp": ("google.cloud.storage", "google.cloud.compute_v1"),
    "gpu": ("pynvml",),
}

_STORE_SCHEMES = {"s3": "aws", "gs": "gcp"}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of None
        return False


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here (empty: it is installed)."""
    return [m for m in EXTRAS[extra] if not _present(m)]


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` into the environment spotguard runs from."""
    return f"{sys.executable} -m pip install 'spotguard[{extra}]'"


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless ``extra`` is installed; ``what`` names the thing
    that needs it (``store s3://bucket``, ``provider gcp``)."""
    gone = missing(extra)
    if gone:
        raise MissingExtra(
            f"{what} needs the '{extra}' extra, which is not installed (no module "
            f"{gone[0]!r}): install it with {install_hint(extra)}",
            extra=extra,
        )


def require_for_store(url: str) -> None:
    """:func:`require` the extra of a store URL's scheme (``file://`` needs none)."""
    extra = _STORE_SCHEMES.get(urlparse(url).scheme.lower())
    if extra is not None:
        require(extra, f"store {url}")
