"""Where each cloud's metadata service is, following each cloud SDK's own convention.

* AWS: ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (botocore), a URL such as ``http://127.0.0.1:1338/``.
* GCP: ``GCE_METADATA_HOST`` (google-auth), ``host[:port]`` without a scheme.
* Azure: ``SPOTGUARD_AZURE_METADATA_ENDPOINT`` (Azure's SDKs have no such variable), a URL.

All three default to the link-local address every cloud serves its metadata on, so detection
needs no DNS lookup (``metadata.google.internal`` resolves to the same address on GCP).
"""

from __future__ import annotations

import os

AWS_ENV = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
GCP_ENV = "GCE_METADATA_HOST"
AZURE_ENV = "SPOTGUARD_AZURE_METADATA_ENDPOINT"
LINK_LOCAL = "169.254.169.254"


def _url(value: str) -> str:
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"


def aws_endpoint(explicit: str | None = None) -> str:
    """Base URL of the AWS instance metadata service (no trailing slash)."""
    return _url(explicit or os.environ.get(AWS_ENV) or LINK_LOCAL)


def gcp_endpoint(explicit: str | None = None) -> str:
    """Base URL of the GCP metadata server (no trailing slash, without ``/computeMetadata``)."""
    return _url(explicit or os.environ.get(GCP_ENV) or LINK_LOCAL)


def azure_endpoint(explicit: str | None = None) -> str:
    """Base URL of the Azure instance metadata service (no trailing slash)."""
    return _url(explicit or os.environ.get(AZURE_ENV) or LINK_LOCAL)
